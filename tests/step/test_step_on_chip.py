"""The step's math on the chip (the TPU tier, ``GEMPORT_TPU=1``): splash attention, the chunked loss and LoRA
dropout against the CPU's paths and a float64 reference, at real head widths and windows, on packed rows.

Each comparison's floor is measured in the same run: how far the CPU's path (the blockwise attention, the chunked
loss on XLA:CPU) lands from the float64 reference of the same inputs, at least the dtype's rounding of the result.
The chip passes at up to ``on_chip.MULTIPLE`` times it; each run is recorded (``on_chip.record``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from on_chip import ATTENTION_LAYERS as LAYERS
from on_chip import DTYPES, chip, cpu, judged, on, relative

from gemport.lora import LoraSpec, dropout_key, lora_dropout
from gemport.run.model import lora_model
from gemport.specs import GemmaSpec
from gemport.step.attention import attend, segment_attention
from gemport.step.chunked_loss import target_nll

pytestmark = pytest.mark.tpu

T = 2048
SEGMENTS = ([700, 900, 300], [1024, 1000])  # two packed rows, each padded at the end (segment 0)
PRECISION = {"float32": "highest", "bfloat16": "default"}  # as step.precision gives each recipe's
EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-8}  # each dtype's unit roundoff
KERNEL_GRADIENTS = 2.0**-16
"""What the chip cannot match: splash attention's backward kernels multiply float32 operands at about three
bfloat16 passes' precision (2^-16) whatever the precision asked, where the forward holds float32's (measured on a
v5e: dq 4.1e-5 to 5.5e-5 from float64, 31 to 69 x the blockwise path's float32 floor; docs/tpu.md)."""


def segment_ids():
    ids = np.zeros((len(SEGMENTS), T), np.int32)
    for row, lengths in enumerate(SEGMENTS):
        ids[row, :sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return ids


def dense(q, k, v, seg, window, d_out):
    """Attention and its gradients in float64, dense: q [B, T, N, H], k, v [B, T, K, H], seg [B, T], d_out as
    the output; query head n reads key head n // (N / K). Returns (out, dq, dk, dv)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    pos = np.arange(t)
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r in range(b):
        mask = (seg[r][:, None] == seg[r][None, :]) & (pos[None, :] <= pos[:, None])
        if window is not None:
            mask &= pos[:, None] - pos[None, :] < window
        for head in range(n):
            kh, vh = k[r, :, head // group], v[r, :, head // group]
            s = np.where(mask, q[r, :, head] @ kh.T, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[r, :, head] = p @ vh
            dp = d_out[r, :, head] @ vh.T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True))
            dq[r, :, head] = ds @ kh
            dk[r, :, head // group] += ds.T @ q[r, :, head]
            dv[r, :, head // group] += p.T @ d_out[r, :, head]
    return out, dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_splash_attention_equals_the_blockwise_path_and_the_float64_reference(layer, dtype):
    cfg = LAYERS[layer]
    rng = np.random.default_rng(0)
    b, n, kv, h = len(SEGMENTS), cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = (rng.standard_normal((b, T, n, h)) * h**-0.5).astype(dtype)
    k = rng.standard_normal((b, T, kv, h)).astype(dtype)
    v = k if cfg.get("k_eq_v") else rng.standard_normal((b, T, kv, h)).astype(dtype)
    d_out = rng.standard_normal((b, T, n, h)).astype(dtype)
    seg = segment_ids()
    want = dense(q, k, v, seg, cfg["window"], d_out)
    real = seg > 0  # padding's outputs are dropped by the loss

    def run(device, fn):
        def f(q, k, v, d_out):
            out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, seg, cfg["window"]), q, k, v)
            return (out, *pull(d_out))

        with jax.default_matmul_precision(PRECISION[dtype]):
            return jax.device_get(jax.jit(f)(*on(device, (q, k, v, d_out))))

    blockwise = run(cpu(), lambda q, k, v, seg, window: segment_attention(q, k, v, seg, window=window))
    splash = run(chip(), attend)
    verdicts = []
    for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        pick = (lambda x: x[real]) if name in ("out", "dq") else (lambda x: x)
        least = KERNEL_GRADIENTS if dtype == "float32" and name != "out" else EPS[dtype]
        verdicts.append(judged("splash_attention", f"{layer} {dtype} {name}",
                               relative(pick(splash[i]), pick(want[i])), relative(pick(blockwise[i]), pick(want[i])),
                               least, layer=layer, dtype=dtype, quantity=name))
    assert all(verdicts)


def test_the_chunked_loss_on_the_chip_equals_the_cpus():
    """Gemma 3 1B's embedding (262144 x 1152, bfloat16): the per-target losses and their gradient in the hidden
    states, as the step computes them, against float64 log-softmax over the same bfloat16 logits."""
    spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), num_layers=1, layer_types=("global",))
    model = lora_model(spec, LoraSpec(rank=4, alpha=8, targets=("q_proj",)), param_dtype=jnp.bfloat16,
                       abstract=False)
    rng = np.random.default_rng(1)
    hidden = (rng.standard_normal((2, 256, spec.hidden)) * 3).astype(jnp.bfloat16)
    tokens = rng.integers(0, spec.vocab, (2, 256)).astype(np.int32)
    g = rng.standard_normal((2, 255)).astype(np.float32)

    def run(device):
        m = on(device, model)

        def f(hidden):
            nll, pull = jax.vjp(lambda x: target_nll(m, x, tokens), hidden)
            return nll, pull(g)[0]

        return jax.device_get(jax.jit(f)(on(device, hidden)))

    embedding = np.asarray(model.embedder.input_embedding.get_value(), np.float64)
    h = np.asarray(hidden[:, :-1], np.float64)
    # The bfloat16 logits Tunix's decode gives, then float64: log-softmax, and the gradient in the hidden states.
    logits = np.asarray(np.asarray(h @ embedding.T, np.float32).astype(jnp.bfloat16), np.float64)
    top = logits.max(-1, keepdims=True)
    p = np.exp(logits - top)
    total = p.sum(-1, keepdims=True)
    want_nll = (np.log(total) + top)[..., 0] - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    p /= total
    np.put_along_axis(p, tokens[:, 1:, None], np.take_along_axis(p, tokens[:, 1:, None], -1) - 1, -1)
    want_dh = np.zeros(hidden.shape)
    want_dh[:, :-1] = (p * g[..., None]) @ embedding
    del p
    # The logits are bfloat16, rounded from products the chip accumulates in another order than the CPU: a logit
    # may round to its other neighbour, which moves the nll up to twice the logits' unit roundoff.
    rounding = 2 * EPS["bfloat16"] * float(np.abs(logits).max()) / float(np.abs(want_nll).max())
    (cpu_nll, cpu_dh), (chip_nll, chip_dh) = run(cpu()), run(chip())
    assert all([
        judged("chunked_loss", "gemma3-1b vocab nll", relative(chip_nll, want_nll), relative(cpu_nll, want_nll),
               rounding, quantity="nll"),
        judged("chunked_loss", "gemma3-1b vocab d_hidden", relative(chip_dh, want_dh), relative(cpu_dh, want_dh),
               EPS["bfloat16"], quantity="d_hidden")])


def test_lora_dropout_draws_the_same_masks_on_the_chip():
    """Dropout 0.5 on every projection: the LoRA gradients on the chip and on the CPU, at float32 products, are
    as far apart as without dropout (the floor: the same step with no mask); other masks would move them by
    their own size."""
    spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), num_layers=2, hidden=256, mlp=512, num_heads=2,
                               num_kv_heads=1, head_dim=128, vocab=512, layer_types=("sliding", "global"))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, spec.vocab, (2, 256)).astype(np.int32)
    positions = np.broadcast_to(np.arange(256, dtype=np.int32), (2, 256))

    def grads(device, dropout):
        lora = LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj", "o_proj", "down_proj"), dropout=dropout)
        model = on(device, lora_model(spec, lora, param_dtype=jnp.float32, abstract=False))

        def loss(model):
            with lora_dropout(model, dropout_key(5, 3)):
                logits, _ = model(tokens, positions, None, np.tril(np.ones((2, 256, 256), bool)))
            return (logits.astype(jnp.float32) ** 2).mean()

        with jax.default_matmul_precision("highest"):
            g = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(nnx.state(g)))])

    floor = relative(grads(chip(), 0.0), grads(cpu(), 0.0))
    assert judged("lora_dropout", "masks p=0.5", relative(grads(chip(), 0.5), grads(cpu(), 0.5)), floor, EPS["float32"])
