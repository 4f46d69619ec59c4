"""LoRA trains as PEFT's does: same trainable parameters, same gradient per PEFT factor, same optimizer steps.

Each case builds a tiny Gemma with transformers, puts PEFT LoRA on all seven projections (so Tunix's fused
kv_einsum / qkv_einsum are involved; on the MoE miniature also PEFT's ``target_parameters`` on the stacked expert
weights and the router, gemport.lora.experts) or on PEFT's default q_proj + v_proj (``+qv``: only some projections of a
fused module, whose others are zero slots), gives every factor random values (at PEFT's init B = 0 and A gets
no gradient, which would hide a wrong A), imports the adapter, and compares against torch on the PEFT model.
"""

import copy
import math

import float64
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from gemport.checkpoint import export_merged, export_peft, import_peft, load_model
from gemport.errors import LoraError
from gemport.lora import PROJECTIONS, LoraLayout, LoraParams, LoraSpec, apply_lora
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec
from peft_training import EXPERTS, batch, jax_loss, peft_grads, peft_model, torch_loss

CASES = ["gemma4_dense", "gemma4_moe", "gemma3_1b", "gemma3_qkv", "gemma4_dense+qv", "gemma3_qkv+qv"]
QV = ["q_proj", "v_proj"]  # PEFT's default targets for gemma3_text and gemma4
RECIPE = {"learning_rate": 5e-3, "weight_decay": 0.1, "max_grad_norm": 0.5, "warmup_steps": 3,
          "lr_scheduler_type": "cosine"}
STEPS = 10


@pytest.fixture(scope="module", params=CASES)
def case(request, hf_checkpoint, tmp_path_factory):
    """(PEFT model, HF checkpoint, spec, the adapter imported: state and lora_spec), all fp32."""
    name, qv = request.param.removesuffix("+qv"), request.param.endswith("+qv")
    _, path = hf_checkpoint(name)
    experts = {"target_parameters": EXPERTS} if name == "gemma4_moe" else {}
    model = peft_model(path, peft.LoraConfig(r=4, lora_alpha=8, target_modules=QV if qv else list(PROJECTIONS),
                                              **experts))
    adapter = tmp_path_factory.mktemp(f"{request.param}-adapter")
    model.save_pretrained(adapter)
    spec = GemmaSpec.from_hf(path)
    return (model, path, spec, *import_peft(adapter, spec=spec))


def zero_slots(layout, flat):
    """The slices of separate factors that belong to projections PEFT does not adapt (rank 0)."""
    return [(adapter.module, factor[i]) for adapter in layout for factor in (flat[adapter.lora_a], flat[adapter.lora_b])
            for i, r in enumerate(adapter.ranks) if adapter.separate and r == 0]


def peft_tensors(layout, flat):
    """gemport's factors, or their gradients, ``{dotted path: array}``, as PEFT's ``{key: array}``."""
    out, text = {}, "base_model.model.model."
    for adapter, a, b in layout.match(flat):
        for module, (A, B) in zip(adapter.hf_modules, adapter.to_peft(a, b)):
            out |= {f"{text}{module}.lora_A.weight": A, f"{text}{module}.lora_B.weight": B}
    for adapter, a, b in layout.match_experts(flat):
        key = text + adapter.peft_key(layout.lora_spec.parameters)
        out |= dict(zip((f"{key}.lora_A.weight", f"{key}.lora_B.weight"), adapter.to_peft(a, b)))
    return out


def peft_factors(model):
    return {n.replace(".default", ""): p.detach().numpy() for n, p in model.named_parameters() if p.requires_grad}


def float64_peft_grads(case, tokens, attention):
    """PEFT's gradients in float64 with no float32 step (see tests/helpers/float64.py), on the case's adapter."""
    model, path = case[:2]
    mode = float64.TorchFloat64()
    with mode:
        # torch's grouped matmul, transformers' default for MoE experts, has no float64 kernel.
        base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                                 attn_implementation=attention,
                                                                 experts_implementation="eager")
        model64 = peft.get_peft_model(base, model.peft_config["default"])
        model64.load_state_dict(model.state_dict())
        mode.float32_results.clear()  # PEFT creates its factors in float32 before moving them to the base's dtype
        torch_loss(model64, tokens).backward()
    assert not mode.float32_results, mode.float32_results
    return peft_grads(model64)


def test_gradients_equal_peft_for_every_factor(case, monkeypatch):
    """In float64 on both sides, without the float32 steps each keeps by default (norms, RoPE, softmax in
    transformers; those and the logits in Tunix's Gemma 4). The bound comes from the run: PEFT's own float64
    gradients with eager and with sdpa attention differ by float64 rounding (~2e-14); Tunix reorders every
    contraction, not only attention, so it may differ by a few times that: 100x. A single float32 step anywhere
    would show as ~1e-5."""
    model, path, spec, state, lora_spec = case
    tokens = batch(spec.vocab, 0)
    expected = float64_peft_grads(case, tokens, "eager")
    sdpa = float64_peft_grads(case, tokens, "sdpa")
    floor = max(np.linalg.norm(sdpa[k] - want) / np.linalg.norm(want) for k, want in expected.items())
    bound = 100 * floor
    with float64.tunix_float64(monkeypatch):
        state = jax.tree.map(lambda x: x.astype(jnp.float64), state)
        tunix_model = apply_lora(load_model(path, param_dtype=jnp.float64), spec, LoraParams(state, lora_spec))
        grad = nnx.jit(nnx.grad(jax_loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
        assert not float64.jax_float32_values(grad, tunix_model, jnp.asarray(tokens))
        grads = grad(tunix_model, jnp.asarray(tokens))
        flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    layout = LoraLayout(spec, lora_spec)
    assert set(flat) == set(layout.shapes())  # nothing else is trainable
    compared, worst = 0, 0.0
    for key, got in peft_tensors(layout, flat).items():
        want = expected.pop(key)
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= bound, (key, error, bound)
        worst = max(worst, error)
        compared += 1
    assert not expected and compared == 2 * (sum(len(a.hf_modules) for a in layout) + len(layout.experts))
    assert bool(layout.experts) == (spec.num_experts > 0)
    slots = zero_slots(layout, flat)
    assert bool(slots) == (list(lora_spec.targets) == QV)
    assert all(not g.any() for _, g in slots)  # an untargeted projection's slot gets no gradient at all
    print(f"float64 gradients: worst {worst:.2e}, eager-vs-sdpa floor {floor:.2e}, bound {bound:.2e}")


def torch_steps(model, vocab):
    """The losses of STEPS steps of the recipe on torch (AdamW, HF's cosine schedule, clipping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch_opt = torch.optim.AdamW(params, lr=RECIPE["learning_rate"], weight_decay=RECIPE["weight_decay"])
    scheduler = transformers.get_scheduler("cosine", torch_opt, num_warmup_steps=RECIPE["warmup_steps"],
                                           num_training_steps=STEPS)
    losses = []
    for step in range(STEPS):
        torch_opt.zero_grad()
        loss = torch_loss(model, batch(vocab, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, RECIPE["max_grad_norm"])
        torch_opt.step()
        scheduler.step()
        losses.append(loss.item())
    return np.array(losses)


# kv_einsum, qkv_einsum, the MoE block's routing (differentiated through) with LoRA on its experts, and PEFT's
# default q_proj + v_proj (a zero slot of qkv_einsum).
@pytest.mark.parametrize("case", ["gemma4_dense", "gemma4_moe", "gemma3_qkv", "gemma3_qkv+qv"], indirect=True)
def test_ten_optimizer_steps_follow_torch(case):
    """Each step's loss, and each trained factor, within 10x torch's own float32 distance from the same steps in
    float64 (no float32 step). Zero slots stay exactly zero through AdamW with weight decay."""
    model, path, spec, state, lora_spec = case
    model32 = copy.deepcopy(model)
    torch_losses = torch_steps(model32, spec.vocab)
    with float64.TorchFloat64():
        base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                                 experts_implementation="eager")
        model64 = peft.get_peft_model(base, model.peft_config["default"])
        model64.load_state_dict(model.state_dict())
        exact = torch_steps(model64, spec.vocab)
    tunix_model = apply_lora(load_model(path), spec, LoraParams(state, lora_spec))
    optimizer = nnx.Optimizer(tunix_model, hf_optimizer(RECIPE, num_training_steps=STEPS).tx, wrt=nnx.LoRAParam)
    value_and_grad = nnx.jit(nnx.value_and_grad(jax_loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
    jax_losses = []
    for step in range(STEPS):
        value, grads = value_and_grad(tunix_model, jnp.asarray(batch(spec.vocab, step)))
        optimizer.update(tunix_model, grads)
        jax_losses.append(float(value))
    floor = np.max(np.abs(torch_losses - exact) / exact)
    error = np.max(np.abs(np.array(jax_losses) - exact) / exact)
    assert 0 < floor < 1e-3 and error <= 10 * floor, (error, floor)
    print(f"losses: worst {error:.1e}, {error / (10 * floor):.2f} of the bound {10 * floor:.1e}")
    assert abs(torch_losses[-1] - torch_losses[0]) > 1e-3  # the steps moved the model
    layout = LoraLayout(spec, lora_spec)
    flat = {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(tunix_model, nnx.LoRAParam))}
    assert all(not x.any() for _, x in zero_slots(layout, flat))
    want, torch32 = peft_factors(model64), peft_factors(model32)
    factor_floor, factor_error = 0.0, 0.0
    for key, got in peft_tensors(layout, flat).items():
        norm = np.linalg.norm(want[key])
        factor_floor = max(factor_floor, np.linalg.norm(torch32.pop(key) - want[key]) / norm)
        factor_error = max(factor_error, np.linalg.norm(got - want.pop(key)) / norm)
    assert not want and not torch32 and 0 < factor_floor and factor_error <= 10 * factor_floor, \
        (factor_error, factor_floor)


def test_trainable_count_equals_peft_for_fresh_adapters(hf_checkpoint):
    """Same LoraConfig, same tiny model: apply_lora(LoraSpec.from_peft(cfg)) trains PEFT's number of parameters."""
    cases = {
        "gemma4_dense": peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        "gemma4_ple": peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS)),
        "gemma3_1b": peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "k_proj"]),
        "gemma3_qkv": peft.LoraConfig(r=3, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                                      rank_pattern={"down_proj": 5}),
    }
    for name, config in cases.items():
        torch_model, path = hf_checkpoint(name)
        spec = GemmaSpec.from_hf(path)
        lora_spec = LoraSpec.from_peft(config)  # before get_peft_model, which resolves "all-linear" in place
        expected = peft.get_peft_model(copy.deepcopy(torch_model), config).get_nb_trainable_parameters()[0]
        lora_model = apply_lora(load_model(path), spec, lora_spec)
        count = sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(lora_model, nnx.LoRAParam)))
        assert count == expected == LoraLayout(spec, lora_spec).num_params, name


@pytest.mark.parametrize("init", ["peft", "gaussian"])
def test_q_and_v_targets_count_and_start_as_peft(hf_checkpoint, init):
    """PEFT's default targets (q_proj + v_proj, which recipes also set explicitly): PEFT's trainable count; the
    slots of the projections they leave out of kv_einsum / qkv_einsum start zero (gaussian init divides by the
    rank, 0 there), the adapted A's are drawn, every B is zero."""
    for name in ("gemma4_dense", "gemma3_1b", "gemma3_qkv"):
        torch_model, path = hf_checkpoint(name)
        spec = GemmaSpec.from_hf(path)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=QV,
                                 init_lora_weights=True if init == "peft" else "gaussian")
        lora_spec = LoraSpec.from_peft(config)
        wrapped = peft.get_peft_model(copy.deepcopy(torch_model), config)
        layout = LoraLayout(spec, lora_spec)
        assert layout.num_params == wrapped.get_nb_trainable_parameters()[0], name
        lora_model = apply_lora(load_model(path), spec, lora_spec, seed=3)
        flat = {".".join(map(str, p)): np.asarray(v.get_value())
                for p, v in nnx.to_flat_state(nnx.state(lora_model, nnx.LoRAParam))}
        slots = zero_slots(layout, flat)
        assert slots and all(not x.any() for _, x in slots), name
        for adapter in layout:
            for A, B in adapter.to_peft(flat[adapter.lora_a], flat[adapter.lora_b]):
                assert np.isfinite(A).all() and np.abs(A).min() > 0 and not B.any(), name


@pytest.mark.parametrize("case", ["gemma4_dense+qv", "gemma3_qkv+qv"], indirect=True)
def test_peft_default_targets_export_and_import_exactly(case, tmp_path):
    """q_proj + v_proj: export_peft writes PEFT's own tensors (none for k_proj), which PEFT loads to the same
    logits; import of the export gives the factors back, zero slots included; a merged export changes exactly
    the adapted projections."""
    import safetensors.numpy

    model, path, spec, state, lora_spec = case
    lora = LoraParams(state, lora_spec)
    out = export_peft(lora, tmp_path / "peft", base_dir=path)
    written = safetensors.numpy.load_file(out / "adapter_model.safetensors")
    want = {k: v.numpy() for k, v in peft.get_peft_model_state_dict(model).items()}
    assert written.keys() == want.keys() and all(np.array_equal(written[k], want[k]) for k in want)
    assert {k.split(".")[-3] for k in written} == set(QV)
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager"),
        out).eval()
    ids = torch.as_tensor(batch(spec.vocab, 0), dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    again = import_peft(out, spec=spec)
    assert again.lora_spec == lora_spec
    flat, flat2 = lora.flat(), again.flat()
    assert flat.keys() == flat2.keys() and all(np.array_equal(flat[k], flat2[k]) for k in flat)
    merged = export_merged(lora, tmp_path / "merged", base_dir=path)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    changed = {k for k, v in transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
               .state_dict().items() if not torch.equal(v, base[k])}
    assert changed == {k.removeprefix("base_model.model.").replace(".lora_A", "") for k in want if ".lora_A" in k}


def test_all_linear_on_models_with_more_linears_is_refused(hf_checkpoint):
    """PEFT's all-linear adapts per-layer-input projections (E2B/E4B) and the MoE router too: refused, named."""
    for name, module in (("gemma4_ple", "per_layer_input_gate"), ("gemma4_moe", "router")):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        lora_spec = LoraSpec.from_peft(config)
        peft.get_peft_model(copy.deepcopy(hf_checkpoint(name)[0]), config)
        assert set(config.target_modules) - set(PROJECTIONS)  # what PEFT really adapts there
        with pytest.raises(LoraError, match=module):
            LoraLayout(GemmaSpec.from_hf(hf_checkpoint(name)[1]), lora_spec).adapters


@pytest.mark.parametrize("init", ["peft", "gaussian"])
def test_fresh_adapter_starts_from_peft_distribution(hf_checkpoint, init):
    """B is zero, A's shapes are PEFT's, and A's bound and std are those of PEFT's initialisation."""
    torch_model, path = hf_checkpoint("gemma3_qkv")
    spec = GemmaSpec.from_hf(path)
    rank = 8
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=list(PROJECTIONS),
                             init_lora_weights=True if init == "peft" else "gaussian")
    torch.manual_seed(0)
    pm = peft.get_peft_model(copy.deepcopy(torch_model), config)
    expected = {n.replace(".default", ""): p.detach().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    lora_spec = LoraSpec.from_peft(config)
    assert lora_spec.init == init
    lora_model = apply_lora(load_model(path), spec, lora_spec, seed=3)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(lora_model))
            if isinstance(v, nnx.LoRAParam)}
    for adapter in LoraLayout(spec, lora_spec):
        for module, (A, B) in zip(adapter.hf_modules, adapter.to_peft(flat[adapter.lora_a], flat[adapter.lora_b])):
            want_A = expected[f"base_model.model.model.{module}.lora_A.weight"]
            assert A.shape == want_A.shape and B.shape == expected[f"base_model.model.model.{module}.lora_B.weight"].shape
            assert not B.any()
            fan_in = A.shape[1]
            if init == "peft":
                bound = 1 / math.sqrt(fan_in)
                assert np.abs(A).max() <= bound and np.abs(want_A).max() <= bound
                assert np.abs(A).max() > 0.9 * bound
                assert abs(A.std() - bound / math.sqrt(3)) < 0.15 * bound / math.sqrt(3)
            else:
                assert abs(A.std() - 1 / rank) < 0.15 / rank and abs(want_A.std() - 1 / rank) < 0.15 / rank
    # Separate factors of kv_einsum / qkv_einsum are drawn independently per projection.
    a = flat["layers.0.attn.qkv_einsum.w_lora_a"]
    assert not np.allclose(a[0], a[1])
