"""A bfloat16 base trains float32 LoRA factors, as PEFT + TRL keep them: factors, gradients and Adam's moments."""

import jax
import jax.numpy as jnp
import numpy as np
import tiny
from flax import nnx

from gemport.data import pad, stack

from gemport.step import train_step
from gemport.checkpoint import load_model
from gemport.lora import LoraSpec, apply_lora
from gemport.plan import memory_plan
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec
from gemport.step.hf import segment_loss

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)}


def test_a_bfloat16_base_trains_float32_factors_gradients_and_moments(real_checkpoint):
    # A bfloat16 checkpoint with a real one's magnitudes; kv_einsum's separate factors and Qwix's own on the rest.
    _, base = real_checkpoint("gemma4_dense", "bfloat16")
    spec = GemmaSpec.from_hf(base)
    model = apply_lora(load_model(base), spec,
                       LoraSpec.from_peft({"r": 4, "lora_alpha": 8, "target_modules": TARGETS}))
    assert dtypes(nnx.state(model, nnx.LoRAParam)) == {"float32"}
    assert dtypes(nnx.state(model, nnx.Not(nnx.LoRAParam))) == {"bfloat16"}  # the base stays bfloat16
    rng = np.random.default_rng(0)
    # B non-zero, so that A has a gradient in the first step.
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda path, x: 0.05 * jnp.asarray(rng.standard_normal(x.shape), x.dtype) if "lora_b" in str(path) else x, state))
    rows = [(rng.integers(1, spec.vocab, tiny.SEQ).astype(np.int32), np.arange(tiny.SEQ) >= 4) for _ in range(2)]
    batch = stack([pad(rows, tiny.SEQ)], accumulation=1, rows=2)

    # The projections compute in the base's dtype (PEFT casts the float32 adapter's sum back); the factors'
    # gradients are float32.
    attn = model.layers[0].attn
    x = jnp.ones((1, 3, spec.hidden), jnp.bfloat16)
    assert attn.q_einsum(x).dtype == jnp.bfloat16 and all(y.dtype == jnp.bfloat16 for y in attn.kv_einsum(x))
    micro = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    grads = nnx.grad(lambda m: segment_loss(m, micro)[0], argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    assert dtypes(grads) == {"float32"} and any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))

    args = {"learning_rate": 1e-4, "max_steps": 1, "warmup_steps": 0, "lr_scheduler_type": "constant"}
    optimizer = nnx.Optimizer(model, hf_optimizer(args, num_training_steps=1).tx, wrt=nnx.LoRAParam)
    flat = lambda: {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    before = flat()
    metrics = train_step()(model, optimizer, batch)
    assert np.isfinite(float(metrics.loss)) and float(metrics.grad_norm) > 0
    assert dtypes(nnx.state(model, nnx.LoRAParam)) == {"float32"} and dtypes(optimizer.opt_state) == {"float32"}
    # Adam's first update, lr * sign(g) = 1e-4 on entries of A of order 0.1, is below half of bfloat16's spacing
    # there (2e-4): a bfloat16 factor would not move. Each float32 A moves by lr.
    moved = {path: np.abs(a - before[path]).max() for path, a in flat().items() if "lora_a" in path[-1]}
    assert moved and all(m == np.float32(1e-4) or abs(m - 1e-4) < 1e-6 for m in moved.values()), moved

    # The memory plan counts what the run holds: float32 factors and moments beside the bfloat16 base.
    plan = memory_plan(spec, 1, 1, lora_spec=model.lora_spec, param_dtype="bfloat16")
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0) > 0)
    assert plan.lora_bytes == nbytes(nnx.state(model, nnx.LoRAParam))
    assert plan.optimizer_bytes == nbytes(optimizer.opt_state)
    assert plan.base_bytes == nbytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
