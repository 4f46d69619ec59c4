"""The step's products counted from its program (``gemport.plan.flops``) against the arithmetic, and the scanned
decoder's count against the unrolled decoder's: the same layers, so the same products, loops times their trips."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gemport.lora import LoraSpec
from gemport.mesh import make_mesh
from gemport.plan.compiled import step_trainer, trace_step
from gemport.plan.flops import product_flops
from gemport.run.model import lora_model
from gemport.specs import GemmaSpec


def count(f, *args):
    return product_flops(jax.make_jaxpr(f)(*args))


def test_a_product_counts_2mnk_and_its_gradient_twice_more():
    x, w = jnp.ones((4, 6)), jnp.ones((6, 5))
    assert count(jnp.matmul, x, w).flops == 2 * 4 * 6 * 5
    batched = count(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), jnp.ones((3, 4, 6)), jnp.ones((3, 6, 5)))
    assert batched.flops == 3 * 2 * 4 * 6 * 5
    # x's gradient and w's: the forward's product twice more
    assert count(jax.grad(lambda x, w: (x @ w).sum(), argnums=(0, 1)), x, w).flops == 3 * 2 * 4 * 6 * 5


def test_loops_count_their_trips_and_a_cond_its_costliest_branch():
    def layers(x, ws):  # x [4, 8] through len(ws) layers
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    x = jnp.ones((4, 8))
    assert count(layers, x, jnp.ones((5, 8, 8))).flops == 5 * 2 * 4 * 8 * 8
    # remat recomputes the forward product in the backward pass: 4 products a layer, each trip
    remat = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
    scanned = jax.grad(lambda ws: jax.lax.scan(lambda x, w: (remat(x, w), None), x, ws)[0].sum())
    assert count(scanned, jnp.ones((5, 8, 8))).flops == 5 * 4 * 2 * 4 * 8 * 8

    def branch(p, x):
        return jax.lax.cond(p, lambda x: x @ x @ x, lambda x: x @ x, x)

    got = count(branch, True, x[:, :4])
    assert (got.flops, got.uncounted) == (2 * 2 * 4 * 4 * 4, frozenset())


def test_a_while_loop_and_a_pallas_kernel_are_said_to_be_uncounted():
    from jax.experimental import pallas as pl

    def loop(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ c[0], c[1] + 1), (x, 0))[0]

    got = count(loop, jnp.ones((4, 4)))
    assert (got.flops, got.uncounted) == (2 * 4 * 4 * 4, {"while loops"})  # the body once

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] @ x_ref[...]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), interpret=True)
    got = count(lambda x: call(x) @ x, jnp.ones((8, 8)))
    assert (got.flops, got.uncounted) == (2 * 8 * 8 * 8, {"Pallas kernels"})


def test_a_shard_maps_body_counts_once_per_device():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    f = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(PartitionSpec("x"), PartitionSpec()),
                      out_specs=PartitionSpec("x"))
    a = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, PartitionSpec("x")))
    b = jax.device_put(jnp.ones((3, 5)), NamedSharding(mesh, PartitionSpec()))
    assert count(f, a, b).flops == 2 * 8 * 3 * 5  # 4 devices x 2 rows each


def _products(jaxpr) -> int:
    """dot_general equations in a program, each once (loops' bodies once)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    n += _products(getattr(sub, "jaxpr", sub))
    return n


# Gemma 3's Tunix model takes its own pattern (five sliding layers, one global): two blocks of it and one layer
# more; Gemma 4's takes the spec's, three blocks of two and one more.
PATTERNS = {"gemma3-1b": ("sliding",) * 5 + ("global",), "gemma4-31b": ("sliding", "global")}


@pytest.mark.parametrize("preset", ["gemma3-1b", "gemma4-31b"])
def test_the_scanned_steps_products_are_the_unrolled_steps(preset, monkeypatch):
    """The train step ``SFTRun`` trains (decoder remat: whole blocks of the attention pattern scanned, one layer
    past them) counts the products of the unrolled decoder it replaces, from fewer product equations:
    the loop's trips restore them (XLA's cost analysis counts that loop's body once). On Gemma 4 the two are
    equal; on Gemma 3 the scan computes a little more: its body is every block's, so it takes the first layer's
    input gradient, which Tunix's unrolled remat drops (the embedding is frozen), a part of one layer's backward
    pass. Neither computes the frozen weights' gradients (``step.remat.rematerialize``'s ``frozen``)."""
    layers = PATTERNS[preset] * (2 if preset == "gemma3-1b" else 3) + ("sliding",)
    spec = dataclasses.replace(GemmaSpec.preset(preset), num_layers=len(layers), layer_types=layers, hidden=32,
                               mlp=48, num_heads=4, num_kv_heads=2, head_dim=8, vocab=96, sliding_window=4,
                               **({"global_head_dim": 16, "global_kv_heads": 1} if preset == "gemma4-31b" else {}))
    mesh = make_mesh(spec, fsdp=1, tp=1, devices=jax.devices()[:1])

    def step(scan):
        with monkeypatch.context() as m:
            if not scan:
                m.setattr("gemport.step.hf.scanned_decoder", lambda model: model)
            model = lora_model(spec, LoraSpec(rank=2, alpha=4, targets=("q_proj", "v_proj", "down_proj")),
                               remat="decoder")
            return trace_step(step_trainer(model), mesh, 2, 16).traced.jaxpr

    scanned, unrolled = step(True), step(False)
    more = product_flops(scanned).flops - product_flops(unrolled).flops
    assert (more == 0) if preset == "gemma4-31b" else (0 < more < product_flops(unrolled).flops / len(layers))
    assert product_flops(scanned).uncounted == product_flops(unrolled).uncounted == frozenset()
    assert _products(scanned.jaxpr) < _products(unrolled.jaxpr)  # one block's equations: the loop is there
