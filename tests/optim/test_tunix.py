"""The decay rule on Tunix Gemma 4 parameter paths, and hf_optimizer on a Qwix LoRA-only parameter set."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from tunix.models.gemma4 import model as gemma4

from gemport.optim import decay_mask, hf_optimizer

TINY = dict(
    num_layers=2,
    num_embed=64,
    embed_dim=16,
    hidden_dim=32,
    num_heads=2,
    head_dim=8,
    num_kv_heads=1,
    sliding_window_size=4,
    per_layer_input_dim=4,
    global_key_size=8,
)
MOE = dict(enable_moe=True, num_experts=2, num_experts_per_tok=1, expert_dim=8, moe_dense_hidden_dim=32)


def dotted(path):
    return ".".join(str(key) for key in path)


@pytest.mark.parametrize("extra", [{}, MOE], ids=["dense", "moe"])
def test_tunix_paths_exclude_exactly_the_norm_scales_and_skip_scale(extra):
    model = nnx.eval_shape(lambda: gemma4.Gemma4(gemma4.ModelConfig(**TINY, **extra), rngs=nnx.Rngs(0)))
    mask = decay_mask(nnx.as_pure(nnx.state(model, nnx.Param)))
    excluded = {
        jax.tree_util.keystr(path, simple=True, separator=".")
        for path, decayed in jax.tree_util.tree_leaves_with_path(mask)
        if not decayed
    }
    # Found by module type, not by name: every RMSNorm's scale, and each decoder layer's Param that
    # stands for HF's layer_scalar buffer.
    modules = list(nnx.iter_graph(model))
    norm_scales = {f"{dotted(path)}.scale" for path, node in modules if isinstance(node, gemma4.RMSNorm)}
    skip_scales = {f"{dotted(path)}.skip_scale" for path, node in modules if isinstance(node, gemma4.DecoderLayer)}
    assert excluded == norm_scales | skip_scales
    assert {"final_norm.scale", "layers.0.pre_attention_norm.scale", "layers.0.attn._query_norm.scale"} <= excluded


@pytest.fixture(scope="module")
def lora_model():
    config = gemma4.ModelConfig(**{**TINY, "num_layers": 1, "per_layer_input_dim": 0})
    model = gemma4.Gemma4(config, rngs=nnx.Rngs(0))
    provider = qwix.LoraProvider(module_path=".*q_einsum|.*gate_proj", rank=2, alpha=4.0)
    return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())


def loss(model, tokens):
    inputs = tokens[:, :-1]
    causal = jnp.tril(jnp.ones((inputs.shape[1], inputs.shape[1]), jnp.bool_))
    logits, _ = model(inputs, attention_mask=jnp.broadcast_to(causal, (inputs.shape[0], *causal.shape)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


grad_fn = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))


def pure(model, kind):
    return nnx.as_pure(nnx.state(model, kind))


BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam subclasses Param
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, TINY["num_embed"], (2, 6)), jnp.int32)


def test_lora_factors_are_decayed(lora_model):
    lora = pure(lora_model, nnx.LoRAParam)
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(lora)]
    names = [jax.tree_util.keystr(path, simple=True, separator=".") for path in paths]
    assert "layers.0.attn.q_einsum.w_lora_a" in names
    assert all(jax.tree.leaves(decay_mask(lora)))


def test_nnx_optimizer_over_lora_params_steps_like_the_transformation(lora_model):
    model = nnx.clone(lora_model)
    recipe = {"learning_rate": 1e-2, "weight_decay": 0.1, "warmup_steps": 1, "lr_scheduler_type": "linear"}
    tx = hf_optimizer(recipe, num_training_steps=10).tx
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # as tunix's PeftTrainer builds it
    base_before, lora_before = pure(model, BASE), pure(model, nnx.LoRAParam)
    expected_params, expected_state = lora_before, tx.init(lora_before)

    for _ in range(3):
        grads = grad_fn(model, TOKENS)
        updates, expected_state = tx.update(nnx.as_pure(grads), expected_state, expected_params)
        expected_params = optax.apply_updates(expected_params, updates)
        optimizer.update(model, grads)

    lora_after = pure(model, nnx.LoRAParam)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), lora_after, expected_params)
    jax.tree.map(np.testing.assert_array_equal, pure(model, BASE), base_before)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), lora_after, lora_before))
    assert max(moved) > 1e-3


def test_decay_reaches_lora_params_through_nnx_optimizer(lora_model):
    """With zero gradients Adam's step is 0, so one step is pure decay: p * (1 - lr * weight_decay)."""
    model = nnx.clone(lora_model)
    recipe = {"learning_rate": 1e-2, "weight_decay": 0.1, "lr_scheduler_type": "constant"}
    optimizer = nnx.Optimizer(model, hf_optimizer(recipe, num_training_steps=10).tx, wrt=nnx.LoRAParam)
    before = pure(model, nnx.LoRAParam)
    optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.LoRAParam)))
    decayed = pure(model, nnx.LoRAParam)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b * (1 - 1e-2 * 0.1), rtol=1e-6), decayed, before)


def test_accumulation_passes_num_tokens_through_nnx_optimizer(lora_model):
    model = nnx.clone(lora_model)
    tx = hf_optimizer({"learning_rate": 1e-2, "gradient_accumulation_steps": 2}, num_training_steps=10).per_micro_batch
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    before = pure(model, nnx.LoRAParam)
    grads = grad_fn(model, TOKENS)
    optimizer.update(model, grads, num_tokens=10)
    jax.tree.map(np.testing.assert_array_equal, pure(model, nnx.LoRAParam), before)
    optimizer.update(model, grads, num_tokens=10)
    after = jax.tree.leaves(pure(model, nnx.LoRAParam))
    assert any(bool(jnp.any(a != b)) for a, b in zip(after, jax.tree.leaves(before)))
