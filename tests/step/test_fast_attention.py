"""gemport.step.attention against Tunix's own einsum attention: logits and LoRA gradients of tiny Gemma 4 (k_eq_v)
and Gemma 3 models on packed rows, a sliding window reaching across example boundaries, padding and an empty row;
the blockwise kernel against a dense softmax over several tile sizes; the refusal of segment-blind attention."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from flax import nnx

from gemport.checkpoint import load_model
from gemport.data import attention_mask
from gemport.specs import GemmaSpec
from gemport.step import attention
from gemport.errors import BatchError
from gemport.step.attention import (check_segments, segment_attention,
                                     segment_attention_model, segment_blind)
from packed_rows import lora_model, rel_err, rows, summed_loss


def logits_and_grads(model, call):
    """A jitted ``(tokens, positions, segment_ids, loss_mask) -> (logits, LoRA grads of the summed loss)``."""
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora, tokens, positions, segment_ids, loss_mask):
        logits = call(nnx.merge(graphdef, lora, rest), tokens, positions, segment_ids)
        return summed_loss(logits, tokens, loss_mask), logits

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return lambda *batch: (lambda out: (out[0][1], out[1]))(grad(lora, *batch))


def errors(ours, ref):
    (logits, grads), (ref_logits, ref_grads) = ours, ref
    return [rel_err(logits, ref_logits)] + [rel_err(g, r) for g, r in zip(jax.tree.leaves(grads),
                                                                          jax.tree.leaves(ref_grads))]


@pytest.mark.parametrize("name, magnitudes", [("gemma4_dense", "tiny"), ("gemma3_1b", "tiny"),
                                              ("gemma3_qkv", "tiny"), ("gemma3_1b", "real")])
def test_logits_and_lora_grads_match_tunix(hf_checkpoint, real_checkpoint, name, magnitudes):
    """``magnitudes="real"``: a real checkpoint's logits (of order 100) and norm gains (to tens),
    ``tiny.real_magnitudes``, where float32's rounding is a thousand times the miniatures'."""
    model = lora_model(real_checkpoint if magnitudes == "real" else hf_checkpoint, name)
    batch = rows(tiny.text_config(name).vocab_size)
    tunix = logits_and_grads(model, lambda m, tokens, positions, segment_ids: m(
        tokens, positions, None, attention_mask(segment_ids))[0])
    ours = logits_and_grads(model, lambda m, tokens, positions, segment_ids: segment_attention_model(m, block=5)(
        tokens, positions, None, segment_ids)[0])
    ref = tunix(*batch)
    assert len(jax.tree.leaves(ref[1])) >= 2 * 5 * 2  # A and B of q, kv (or k), o and the MLP, two layers
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(ref[1]))
    # Noise floor: Tunix's own step on the same rows in another batch order (float32 sums in another order).
    perm = np.array([2, 0, 1])
    logits, grads = tunix(*(a[perm] for a in batch))
    floor = errors((logits[np.argsort(perm)], grads), ref)
    got = errors(ours(*batch), ref)
    assert max(got) < max(1e-5, 2 * max(floor)), (got, floor)


def dense_reference(q, k, v, segment_ids, window):
    # The mask of data.attention_mask and Tunix's sliding band, as one dense softmax.
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    s = jnp.einsum("btkgh,bskh->btkgs", qg, k)
    idx = jnp.arange(t)
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (idx[None, :] <= idx[:, None])
    if window is not None:
        mask &= idx[:, None] - idx[None, :] < window
    p = jax.nn.softmax(jnp.where(mask[:, :, None, None], s, -2.3819763e38), -1)
    return jnp.einsum("btkgs,bskh->btkgh", p, v).reshape(q.shape)


@pytest.mark.parametrize("window", [None, 3, 7])
@pytest.mark.parametrize("block", [4, 5, 16])
def test_blockwise_tiles_match_a_dense_softmax(window, block):
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    b, t, n, kv_heads, h = 2, 13, 4, 2, 8
    q = jax.random.normal(kq, (b, t, n, h))
    k = jax.random.normal(kk, (b, t, kv_heads, h))
    v = jax.random.normal(kv, (b, t, kv_heads, h))
    d_out = jax.random.normal(kd, (b, t, n, h))
    segment_ids = jnp.array([[1] * 6 + [2] * 5 + [0] * 2, [3] * 13])

    def pull(f):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v), q, k, v)
        return (out, *vjp(d_out))

    ours = pull(lambda q, k, v: segment_attention(q, k, v, segment_ids, window=window, block=block))
    ref = pull(lambda q, k, v: dense_reference(q, k, v, segment_ids, window))
    for a, r in zip(ours, ref):
        assert rel_err(a, r) < 1e-5


def test_segment_blind_attention_refuses_packed_rows(hf_checkpoint):
    _, path = hf_checkpoint("gemma4_dense")
    spec = GemmaSpec.from_hf(path)
    model = load_model(path)
    assert not segment_blind(model)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "config"):
            module.config = dataclasses.replace(module.config, use_flash_attention=True,
                                                use_sliding_window_kv_cache=False)
    assert segment_blind(model)
    _, _, segment_ids, _ = rows(spec.vocab)
    check_segments(model, segment_ids[1:], "train_step")  # one example per row (and padding) is fine
    with pytest.raises(BatchError, match="train_step: row 0 .*use_flash_attention"):
        check_segments(model, segment_ids, "train_step")
    assert not segment_blind(segment_attention_model(model))


SMALL_TILES = attention.splash_tiles(128, 128, fused=True)


@pytest.mark.parametrize("kernel, window, fsdp, tp, axes, length", [
    ("splash", None, 2, 2, "Auto", 128), ("splash", 16, 1, 4, "Auto", 128), ("splash", 16, 1, 1, "Auto", 128),
    ("splash", None, 2, 1, "Auto", 100), ("splash", 16, 1, 1, "Auto", 100),
    ("splash-small-tiles", None, 1, 1, "Auto", 300), ("splash-small-tiles", 16, 1, 1, "Auto", 300),
    ("splash-tf32", 16, 2, 1, "Auto", 128),
    ("pallas-gpu", None, 1, 1, "Auto", 128), ("pallas-gpu", None, 2, 2, "Auto", 128),
    ("pallas-gpu", None, 2, 2, "Explicit", 128),
])
def test_kernels_run_per_device_and_match_blockwise(kernel, window, fsdp, tp, axes, length):
    """The TPU kernel (splash, a LocalMask on sliding layers) and the GPU kernel (JAX's Pallas flash attention,
    global layers) in interpret mode on CPU devices, under a mesh: each device runs the kernel on its own rows
    and KV heads (with their query groups; with tp=4 over 2 KV heads the heads stay whole), and outputs and
    gradients equal blockwise attention on rows of two examples and padding, GQA. gemport's meshes have Auto
    axes; Explicit ones work too. Rows of 100 tokens are not a multiple of splash's 128-token blocks. Splash runs
    its tiles (``SPLASH_BLOCKS``: 512 rows, the fused backward kernel), which a row shorter than a tile takes at its
    own length, one tile; with 128-row tiles, rows of 300 tokens are three tiles each way. Under a tf32 recipe's
    "high" precision splash runs at "highest" (Mosaic has no "high"), forward and backward through its own
    custom_vjp."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    kq, kk, kv, kd = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(kq, (2, length, 4, 64))
    k = jax.random.normal(kk, (2, length, 2, 64))
    v = jax.random.normal(kv, (2, length, 2, 64))
    d_out = jax.random.normal(kd, q.shape)
    first, second = length * 2 // 5, length // 2
    segment_ids = jnp.array([[1] * first + [2] * second + [0] * (length - first - second), [1] * length])
    mesh = jax.make_mesh((fsdp, tp), ("fsdp", "tp"), (AxisType[axes],) * 2, devices=jax.devices()[:fsdp * tp])

    def pull(f):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out))

    if kernel in ("splash", "splash-tf32"):
        local = functools.partial(attention._splash, window=window, interpret=True)
    elif kernel == "splash-small-tiles":
        local = functools.partial(attention._splash, window=window, interpret=True, blocks=SMALL_TILES)
    else:
        local = functools.partial(attention._pallas_gpu, interpret=True)
    with jax.set_mesh(mesh), jax.default_matmul_precision("high" if kernel == "splash-tf32" else None):
        got = jax.jit(lambda: pull(lambda q, k, v: attention._on_mesh(local, q, k, v, segment_ids)))()
    ref = pull(lambda q, k, v: segment_attention(q, k, v, segment_ids, window=window, block=32))
    expected = NamedSharding(mesh, P("fsdp" if fsdp > 1 else None, None, "tp" if tp == 2 else None, None))
    assert got[0].sharding.is_equivalent_to(expected, q.ndim)
    for a, r in zip(got, ref):
        assert rel_err(a, r) < 1e-5


def test_the_gpu_kernel_takes_global_layers_its_blocks_divide():
    assert attention._gpu_kernel_takes(128, None) and attention._gpu_kernel_takes(4096, None)
    assert not attention._gpu_kernel_takes(128, 16)  # sliding layers: blockwise
    assert not attention._gpu_kernel_takes(100, None)  # 100 tokens: not a multiple of its 32-token blocks
