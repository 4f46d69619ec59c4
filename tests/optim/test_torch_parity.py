"""hf_optimizer against the HF Trainer's own optimizer and scheduler on a tiny Gemma 4 with real parameter names.

The reference is built by ``Trainer.create_optimizer_and_scheduler`` (torch AdamW with HF's
weight-decay groups, ``get_scheduler``) and stepped as the Trainer steps it, with
``clip_grad_norm_``; both sides get the same parameters and the same 200 gradients.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Trainer, TrainingArguments

from gemport.optim import clip_grad_norm, decays, hf_optimizer

STEPS = 200


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=8,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        attention_bias=True,
    )
    return Gemma4ForCausalLM(config)


@pytest.fixture(scope="module")
def gradients(model):
    """200 random gradients whose global norm spans 0.1..13, so clipping at 1.0 acts on some steps only."""
    rng = np.random.default_rng(0)
    scales = 10 ** rng.uniform(-2.8, -0.8, STEPS)
    return {
        name: (rng.standard_normal((STEPS, *p.shape)) * scales.reshape(-1, *[1] * p.dim())).astype(np.float32)
        for name, p in model.named_parameters()
    }


def hf_run(model, args, gradients, dtype=torch.float32):
    """Steps HF's optimizer and scheduler in ``dtype``; returns final parameters and the learning rate of each step."""
    model = copy.deepcopy(model).to(dtype)
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    params = dict(model.named_parameters())
    lrs = []
    for step in range(STEPS):
        for name, p in params.items():
            p.grad = torch.from_numpy(gradients[name][step]).to(dtype, copy=True)  # clipping scales it in place
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        lrs.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    return {name: p.detach().numpy().copy() for name, p in params.items()}, np.array(lrs)


def optax_run(tx, params, gradients):
    @jax.jit
    def run(params, gradients):
        def step(carry, grads):
            params, state = carry
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), gradients)
        return params

    out = run(jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, gradients))
    return {name: np.asarray(v) for name, v in out.items()}


def relative_error(a, b):
    return max(np.abs(a[n] - b[n]).max() for n in b) / max(np.abs(b[n]).max() for n in b)


def tolerance(model, args, gradients, expected):
    """10x the distance of HF's own float32 run (``expected``) from the same run in float64: no reduction but the
    clipping norm, so the float32 floor is that of AdamW's elementwise arithmetic over 200 steps."""
    exact, _ = hf_run(model, args, gradients, torch.float64)
    floor = relative_error(expected, exact)
    assert 0 < floor < 1e-4
    return 10 * floor


def initial(model):
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


def test_decay_rule_equals_hf_get_decay_parameter_names(model):
    names = [name for name, _ in model.named_parameters()]
    hf_decayed = set(Trainer.get_decay_parameter_names(None, model))
    # HF's list also names the tied lm_head.weight, which named_parameters() yields once as the embedding.
    assert {name for name in {*names, *hf_decayed} if decays(name)} == hf_decayed
    excluded = set(names) - hf_decayed
    assert {
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.per_layer_projection_norm.weight",
    } <= excluded
    assert "model.layers.0.self_attn.q_proj.weight" in hf_decayed


def test_decay_rule_equals_hf_on_a_peft_lora_model(model):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    names = [name for name, _ in lora.named_parameters()]
    assert any("lora_A" in name for name in names)
    hf_decayed = set(Trainer.get_decay_parameter_names(None, lora))
    assert {name for name in {*names, *hf_decayed} if decays(name)} == hf_decayed


CASES = {
    "linear": dict(lr_scheduler_type="linear", warmup_steps=20),
    "cosine": dict(lr_scheduler_type="cosine", warmup_steps=0.1),
    "cosine_with_restarts": dict(
        lr_scheduler_type="cosine_with_restarts", warmup_steps=0.05, lr_scheduler_kwargs={"num_cycles": 3}
    ),
    "polynomial": dict(
        lr_scheduler_type="polynomial", warmup_steps=10, lr_scheduler_kwargs={"lr_end": 1e-4, "power": 2.0}
    ),
    "constant": dict(lr_scheduler_type="constant"),
    "constant_with_warmup": dict(lr_scheduler_type="constant_with_warmup", warmup_steps=30),
}


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("case", CASES)
def test_200_steps_match_hf_trainer(model, gradients, tmp_path, case, max_grad_norm):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=1e-2,
        weight_decay=0.1,
        adam_beta1=0.85,
        adam_beta2=0.98,
        adam_epsilon=1e-7,
        max_grad_norm=max_grad_norm,
        # HF's default optim; fused AdamW is slow on CPU, so only one case runs it.
        optim="adamw_torch_fused" if case == "linear" else "adamw_torch",
        **CASES[case],
    )
    expected, hf_lrs = hf_run(model, args, gradients)
    start = initial(model)
    tx, schedule, _ = hf_optimizer(args, num_training_steps=STEPS, params=start if max_grad_norm else None)

    np.testing.assert_array_equal(np.asarray(schedule(jnp.arange(STEPS))), hf_lrs.astype(np.float32))
    bound = tolerance(model, args, gradients, expected)
    error = relative_error(optax_run(tx, start, gradients), expected)
    assert error < bound
    print(f"{case}: {error:.1e} of {bound:.1e}")
    # Parameters moved by far more than the tolerance, so the comparison above is not vacuous.
    assert relative_error(start, expected) > 1000 * bound


def test_decaying_norms_and_biases_too_misses_the_tolerance(model, gradients, tmp_path):
    """The tolerance tells HF's step from optax.adamw without HF's exclusions."""
    args = TrainingArguments(
        output_dir=str(tmp_path), learning_rate=1e-2, weight_decay=0.1, warmup_steps=20, optim="adamw_torch"
    )
    expected, _ = hf_run(model, args, gradients)
    start = initial(model)
    schedule = hf_optimizer(args, num_training_steps=STEPS).schedule
    decay_everything = optax.chain(clip_grad_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    assert relative_error(optax_run(decay_everything, start, gradients), expected) > 100 * tolerance(
        model, args, gradients, expected)


def test_clipping_changes_the_trajectory(model, gradients, tmp_path):
    """Clipping at 1.0 acts on these gradients, so the clipped cases test the clipping rule."""
    base = dict(output_dir=str(tmp_path), learning_rate=1e-2, warmup_steps=20, optim="adamw_torch")
    clipped, _ = hf_run(model, TrainingArguments(max_grad_norm=1.0, **base), gradients)
    unclipped, _ = hf_run(model, TrainingArguments(max_grad_norm=0.0, **base), gradients)
    assert relative_error(unclipped, clipped) > 100 * tolerance(
        model, TrainingArguments(max_grad_norm=1.0, **base), gradients, clipped)


@pytest.mark.parametrize("b1, b2", [(0.9, 0.999), (0.85, 0.98), (0.0, 0.0)])
def test_adam_bias_corrections_are_torchs_to_float32_precision(b1, b2):
    """torch corrects Adam's moments by 1 - beta**t in float64; optax.scale_by_adam in float32, where 0.999 is
    0.99900001, so its first updates are ~1e-5 too large on every element (what made the port's grad_norm land
    15-30 x the float32 floor of `gemport parity` on a Gemma 3 miniature). scale_by_torch_adam's updates are
    within a few float32 roundings of the exact float64 ones (max-abs over max-abs, each step)."""
    from gemport.optim.adam import scale_by_torch_adam

    eps, rng = 1e-8, np.random.default_rng(0)
    grads = [rng.normal(size=256) for _ in range(6)]
    unit = np.finfo(np.float32).eps

    def worst(tx):
        state, m, v, out = tx.init({"w": jnp.zeros(256)}), 0.0, 0.0, 0.0
        for t, g in enumerate(grads, 1):
            update, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state)
            g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
            exact = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
            # Max-abs over max-abs: an element whose moment cancels to near 0 has float32 noise of its terms'.
            out = max(out, np.abs(np.asarray(update["w"], np.float64) - exact).max() / np.abs(exact).max())
        return out

    assert worst(scale_by_torch_adam(b1, b2, eps)) <= 8 * unit  # a few roundings: moments, division, root
    if b2 == 0.999:
        assert worst(optax.scale_by_adam(b1, b2, eps)) > 40 * unit  # what it replaces, ~1e-5
