"""Products at the precision the recipe says: what ``step.precision`` sets, read from the program the run trains.

On CPU every float32 product is exact whatever the setting (the chip's effect is in tests/check/test_peers_on_chip.py);
here the lowered train step of ``HFPeftTrainer`` carries the recipe's precision on every ``dot_general``: float32
recipes ``HIGHEST``, ``tf32: true`` ``HIGH``, bfloat16 recipes ``DEFAULT``.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemport.lora import LoraSpec
from gemport.mesh import make_mesh
from gemport.plan.compiled import lower_step, step_trainer
from gemport.run.model import lora_model
from gemport.specs import GemmaSpec
from gemport.step.precision import matmul_precision, with_precision


def dots(text):
    """The ``dot_general``s of a lowered program's ``text``."""
    return re.findall(r"stablehlo\.dot_general.*", text)


def dots_of(fn, *args):
    """The lowered ``dot_general``s of ``jax.jit(fn)`` on ``args``."""
    return dots(jax.jit(fn).lower(*args).as_text())


def test_the_recipe_gives_the_precision():
    assert matmul_precision(bf16=False, tf32=None) == "highest"
    assert matmul_precision(bf16=False, tf32=False) == "highest"
    assert matmul_precision(bf16=False, tf32=True) == "high"
    assert matmul_precision(bf16=True, tf32=None) == "default"
    assert matmul_precision(bf16=True, tf32=True) == "default"  # bfloat16 operands: one pass holds them


def test_with_precision_records_it_on_the_products_and_their_transposes():
    x = jnp.ones((4, 4), jnp.float32)

    def f(a):
        return (a @ a).sum()

    products = dots_of(jax.grad(with_precision(f, "highest")), x)
    assert len(products) == 2 and all("HIGHEST" in d for d in products), products  # two transposed products
    assert not [d for d in dots_of(jax.grad(with_precision(f, "default")), x) if "HIGH" in d]  # JAX's own


@pytest.mark.parametrize("fields, expected", [({"bf16": False}, "HIGHEST"), ({"bf16": False, "tf32": True}, "HIGH"),
                                              ({"bf16": True}, "DEFAULT")], ids=["float32", "tf32", "bfloat16"])
def test_the_trained_step_carries_the_recipe_precision(fields, expected):
    spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), num_layers=2, hidden=64, mlp=128, num_heads=2,
                               num_kv_heads=1, head_dim=16, vocab=256, sliding_window=16,
                               layer_types=("sliding", "global"))
    dtype = jnp.bfloat16 if fields["bf16"] else jnp.float32
    model = lora_model(spec, LoraSpec(rank=4, alpha=8, targets=("q_proj", "down_proj")), param_dtype=dtype,
                       abstract=False)
    trainer = step_trainer(model, {**fields, "gradient_checkpointing": False})
    mesh = make_mesh(spec, fsdp=1, tp=1, devices=jax.devices()[:1])
    text = lower_step(trainer, mesh, 2, 32).as_text()
    products = dots(text)
    assert products and all(f"precision = [{expected}, {expected}]" in d for d in products), products[:3]
    assert "stablehlo.power" not in text  # RoPE's timescales are the host's constants (step.rope), at any precision



@pytest.mark.parametrize("case", ["segment_attention", "target_nll", "rematerialize"])
def test_a_loss_traced_with_precision_keeps_it_in_its_custom_backward_passes(case):
    """``jax.grad(with_precision(loss, "highest"))``: the products of gemport's custom_vjps' backward passes, which
    JAX traces after the wrapped loss has returned, take the loss's precision too (they took JAX's default, one
    bfloat16 pass on a TPU: the chip's float32 parity was 84x its floor at step 0's grad_norm)."""
    from gemport.step.attention import segment_attention
    from gemport.step.chunked_loss import target_nll
    from gemport.step.remat import rematerialize

    rng = np.random.default_rng(0)
    if case == "segment_attention":
        q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float32) for _ in range(3))
        args = (q,)

        def loss(q):
            return segment_attention(q, k, v, jnp.ones((1, 16), jnp.int32), window=None, block=8).sum()
    elif case == "target_nll":
        spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), num_layers=2, hidden=16, mlp=32, num_heads=2,
                                   num_kv_heads=1, head_dim=8, vocab=64, sliding_window=8,
                                   layer_types=("sliding", "global"))
        graphdef, state = nnx.split(spec.tunix_model_class()(spec.to_tunix(param_dtype=jnp.float32),
                                                             rngs=nnx.Rngs(0)))
        tokens = jnp.asarray(rng.integers(0, 64, (1, 8)), jnp.int32)
        args = (jnp.asarray(rng.standard_normal((1, 8, 16)), jnp.float32), nnx.as_pure(state))

        def loss(hidden, state):  # the embedding's gradient too: its backward pass's only product
            return target_nll(nnx.merge(graphdef, state), hidden, tokens, chunk=4, vocab_slice=32).sum()
    else:
        w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
        args = (w,)

        def loss(w):
            return rematerialize(lambda w, x: jnp.tanh(x @ w) @ w)(w, jnp.ones((4, 8), jnp.float32)).sum()

    every = tuple(range(len(args)))
    products = dots_of(jax.grad(with_precision(loss, "highest"), every), *args)
    assert products and all("precision = [HIGHEST, HIGHEST]" in d for d in products), [d[-80:] for d in products]
    assert not [d for d in dots_of(jax.grad(loss, every), *args) if "HIGH" in d]  # unwrapped: JAX's own
