"""Cross-entropy from a Tunix Gemma's final hidden states and its tied embedding, a block of logits at a time.

Tunix's model returns float32 logits [B, T, V] (4 GiB per 4096-token row at Gemma's 262144-token vocabulary, and as
much again for their gradient). Here the logits of ``CHUNK`` tokens against ``VOCAB_SLICE`` embedding rows at a time
are computed from the hidden states (Tunix's ``embedder.decode`` on those rows, then Gemma 4's final softcap) and
folded into each token's log-sum-exp (an online softmax, as flash attention takes it). Memory holds one block of
logits, never a chunk's or the row's, and no float32 copy of the whole embedding: a compiler that computes a
bfloat16 dot in float32 (XLA:CPU) converts one slice of rows at a time, not 262144 x D (``slice_rows``). The
gradient in the hidden states is folded into the forward pass beside the log-sum-exp (a second product per slice,
the softmax-weighted embedding rows), so the loss makes two passes of products over the vocabulary, not three; the
embedding's own gradient, needed only when it is trained, recomputes the logits in the backward pass.

The slices interleave in runs of ``RUN`` rows (slice b of s holds runs b, b + s, b + 2s, ... of the embedding),
so on a mesh whose tp axis splits the vocabulary into up to V / (s x RUN) shards each device reads its own rows of
every slice, without communication, and each run is whole tiles of a TPU's layout.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gemport.mesh.tpu import platform
from gemport.step.precision import backward_at, traced

CHUNK = 512
"""Tokens of each row per block of logits (and per float32 cotangent [B, CHUNK, D] of the backward pass)."""

VOCAB_SLICE = 16384
"""Embedding rows per block of logits: [B, CHUNK, VOCAB_SLICE] float32 (32 MiB a row) are held at once."""

RUN = 512
"""Consecutive embedding rows a slice takes at a time (``run_rows``): whole tiles of a TPU's layout. Rows taken
one at a time (slice b holding rows b, b + s, ...) share each tile of rows with the other slices, so copying one
slice read most of the table: on a v5e that copy was a quarter of the step at Gemma 4 31B's widths (332 of
1,341 ms, 127 GB/s)."""


@functools.cache
def _tap(norm_cls: type) -> type:
    # The final norm, also recording its output: the hidden states Tunix decodes into logits.
    def __call__(self, x):
        y = norm_cls.__call__(self, x)
        self.sow(nnx.Intermediate, "hidden_states", y)
        return y

    return type(f"HiddenStates{norm_cls.__name__}", (norm_cls,), {"__call__": __call__})


def hidden_states(model: nnx.Module, tokens: jax.Array, positions: jax.Array, attention: jax.Array) -> jax.Array:
    """The final hidden states [B, T, D] of a Tunix Gemma 3 / Gemma 4 model (after its final norm), the
    input of its ``embedder.decode``.

    tokens, positions: int [B, T]; attention: what the model takes as ``attention_mask`` (bool [B, T, T] for a
    Tunix model, segment_ids int [B, T] for a ``segment_attention_model``). The model runs as it is (remat,
    LoRA, sharding); its logits are left unused, so XLA drops their computation. ``model`` is not changed.
    """
    copy = nnx.merge(*nnx.split(model))
    copy.final_norm.__class__ = _tap(type(copy.final_norm))
    copy(tokens, positions, None, attention)
    (hidden,) = jax.tree.leaves(nnx.pop(copy, nnx.Intermediate))
    return hidden


def num_slices(vocab: int, vocab_slice: int = VOCAB_SLICE) -> int:
    """The fewest interleaved slices of at most ``vocab_slice`` rows that split ``vocab`` evenly."""
    return next(s for s in range(-(-vocab // vocab_slice), vocab + 1) if vocab % s == 0)


def run_rows(vocab: int, slices: int, run: int = RUN) -> int:
    """Rows of each run of a slice: the least divisor of ``vocab // slices`` that is at least ``run`` (all of the
    slice's rows when it has fewer)."""
    rows = vocab // slices
    return next(r for r in range(min(run, rows), rows + 1) if rows % r == 0)


def _slice_logits(graphdef, state, softcap, slices, run, h_c, b):
    # Slice b's raw logits [C, V / s] as Tunix's decode computes them, its rows [V / s, D], and the softcap's
    # tanh (None without one) and the float32 logits the loss reads.
    embedder = nnx.merge(graphdef, state)
    w_b = slice_rows(embedder.input_embedding.get_value(), slices, b, run=run)
    embedder.input_embedding = nnx.Param(w_b)
    raw = embedder.decode(h_c)
    z = raw.astype(jnp.float32)
    if softcap is None:
        return raw, w_b, None, z
    tanh = jnp.tanh(z / softcap)
    return raw, w_b, tanh, tanh * softcap


def slice_rows(w: jax.Array, slices: int, b: jax.Array, *, run: int = RUN, bits: bool | None = None) -> jax.Array:
    """Slice b of ``slices`` of the embedding ``w`` [V, D]: its runs b, b + s, b + 2s, ... of ``r`` rows each
    (``r = run_rows(V, slices, run)``), [V / s, D], for a traced b.

    E.g. V = 8, s = 2, r = 2: slice 0 is rows 0, 1, 4, 5 and slice 1 rows 2, 3, 6, 7.

    bits: slice a bfloat16 ``w`` as its 16-bit pattern (default: when the trace compiles for CPU,
    ``gemport.mesh.tpu.platform``). XLA:CPU moves no bfloat16 data as such: it would convert the whole
    embedding to float32 to slice it (5 GiB at Gemma's vocabulary), where the bit pattern costs one 16-bit copy.
    Accelerators slice bfloat16 in place. Both give the same rows.
    """
    if bits is None:
        bits = platform() == "cpu"
    v, d = w.shape
    runs = (-1, slices, run_rows(v, slices, run), d)
    if not (bits and w.dtype == jnp.bfloat16):
        return jax.lax.dynamic_index_in_dim(w.reshape(runs), b, axis=1, keepdims=False).reshape(-1, d)
    pattern = jax.lax.bitcast_convert_type(w, jnp.uint16).reshape(runs)
    rows = jax.lax.dynamic_index_in_dim(pattern, b, axis=1, keepdims=False).reshape(-1, d)
    return jax.lax.bitcast_convert_type(rows, w.dtype)


def _split_targets(t_c, slices, run):
    # Token v is in run v // r, the run's row v % r; run k is slice k % s's run k // s, whose rows begin at
    # (k // s) r in the slice.
    k = t_c // run
    return (k // slices) * run + t_c % run, k % slices


def _forward(h, targets, state, graphdef, softcap, slices, run, direction=False):
    # Per chunk: each token's nll and log-sum-exp, folded over the vocabulary slices with an online softmax; with
    # ``direction``, also the gradient of its nll in its hidden state [.., D], folded alike (``_nll_fwd``).
    f32 = jnp.float32
    w = nnx.merge(graphdef, state).input_embedding.get_value()

    def chunk(_, xs):
        h_c, t_c = xs
        row, which = _split_targets(t_c, slices, run)

        def one(carry, b):
            m, l, picked, acc = carry
            raw, w_b, tanh, z = _slice_logits(graphdef, state, softcap, slices, run, h_c, b)
            m_new = jnp.maximum(m, z.max(-1))
            rescale = jnp.exp(m - m_new)
            e = jnp.exp(z - m_new[..., None])
            l = l * rescale + e.sum(-1)
            picked = picked + jnp.where(which == b, jnp.take_along_axis(z, row[..., None], -1)[..., 0], 0.0)
            if direction:
                # sum over the tokens v other than the target of exp(z_v - m) dz_v/draw_v W_v, one product per slice
                # as decode's (float32 accumulation); the target's term is added exactly below.
                weights = e if tanh is None else e * (1 - tanh * tanh)
                weights = jnp.where((which[..., None] == b) & (row[..., None] == jnp.arange(z.shape[-1])), 0.0,
                                    weights)
                acc = rescale[..., None] * acc + jnp.dot(weights.astype(raw.dtype), w_b.astype(raw.dtype),
                                                         preferred_element_type=f32)
            return (m_new, l, picked, acc), None

        c = h_c.shape[:-1]
        acc = jnp.zeros((*c, h_c.shape[-1]) if direction else (), f32)
        init = (jnp.full(c, -jnp.inf, f32), jnp.zeros(c, f32), jnp.zeros(c, f32), acc)
        (m, l, picked, acc), _ = jax.lax.scan(one, init, jnp.arange(slices))
        lse = m + jnp.log(l)
        if not direction:
            return None, (lse - picked, lse, acc)
        # d nll / d h = sum_v p_v dz_v/dh - dz_t/dh, p_v = exp(z_v - lse), dz_v/dh = (1 - tanh_v^2) W_v: the other
        # tokens' sum, and the target's (p_t - 1) dz_t/dh in float32 (near p_t = 1 it is a small difference, which
        # a bfloat16 weight p_t would round away).
        target = jnp.take(w, t_c, axis=0).astype(f32)
        if softcap is not None:
            target = (1 - jnp.square(picked / softcap))[..., None] * target
        return None, (lse - picked, lse, acc / l[..., None] + (jnp.exp(picked - lse) - 1)[..., None] * target)

    _, (nll, lse, grad) = jax.lax.scan(chunk, None, (h, targets))
    return nll, lse, grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _nll(h, targets, state, graphdef, softcap, slices, run, precision):
    return _forward(h, targets, state, graphdef, softcap, slices, run)[0]


def _nll_fwd(h, targets, state, graphdef, softcap, slices, run, precision):
    # The hidden states' gradient is folded into the forward pass (a second product per slice), so the backward
    # pass needs no second pass over the vocabulary's logits for it: two products a slice in all, not three.
    nll, lse, grad = _forward(h, targets, state, graphdef, softcap, slices, run, direction=True)
    return nll, (h, targets, state, lse, grad)


def _nll_bwd(graphdef, softcap, slices, run, precision, residuals, g):
    with backward_at(precision):
        return _nll_grads(graphdef, softcap, slices, run, residuals, g)


def _nll_grads(graphdef, softcap, slices, run, residuals, g):
    h, targets, state, lse, grad = residuals
    f32 = jnp.float32
    w = nnx.merge(graphdef, state).input_embedding.get_value()
    rows = w.shape[0] // slices
    dh = (g[..., None] * grad).astype(h.dtype)

    def chunk(dw, xs):
        h_c, t_c, lse_c, g_c = xs
        row, which = _split_targets(t_c, slices, run)

        def one(dw, b):
            raw, w_b, tanh, z = _slice_logits(graphdef, state, softcap, slices, run, h_c, b)
            target = (which[..., None] == b) & (row[..., None] == jnp.arange(rows))
            dz = g_c[..., None] * (jnp.exp(z - lse_c[..., None]) - target)
            if tanh is not None:
                dz = dz * (1 - tanh * tanh)
            d = dz.astype(raw.dtype)
            dw_b = jnp.einsum("bcv,bcd->vd", d, h_c.astype(raw.dtype), preferred_element_type=f32)
            return dw.at[:, b].add(dw_b.reshape(-1, run, w.shape[-1])), None

        dw, _ = jax.lax.scan(one, dw, jnp.arange(slices))
        return dw, None

    # The embedding's gradient (its logits recomputed) only where it is trained: under LoRA nothing reads it and
    # XLA drops this pass.
    dw, _ = jax.lax.scan(chunk, jnp.zeros((rows // run, slices, run, w.shape[-1]), f32), (h, targets, lse, g))
    d_state = jax.tree.map(jnp.zeros_like, state)
    d_state["input_embedding"] = d_state["input_embedding"].replace(dw.reshape(w.shape).astype(w.dtype))
    return dh, None, d_state


_nll.defvjp(_nll_fwd, _nll_bwd)


def target_nll(model: nnx.Module, hidden: jax.Array, tokens: jax.Array, *, chunk: int = CHUNK,
               vocab_slice: int = VOCAB_SLICE, run: int = RUN) -> jax.Array:
    """Next-token negative log-likelihoods from hidden states, ``chunk`` tokens by ``vocab_slice`` rows' logits
    at a time, each slice of the vocabulary taken in runs of ``run`` rows (``slice_rows``).

    model: the Tunix Gemma whose ``embedder`` (and final logit softcap, if its config has one) turn hidden
    states into logits; hidden: [B, T, D] (``hidden_states``); tokens: int [B, T]. Position t predicts token
    t + 1, as ``step.cross_entropy``. Returns float32 [B, T - 1]: the value of ``step.cross_entropy``' per-target
    loss on Tunix's logits, with float32 log-softmax. Differentiable in ``hidden`` and the embedding (whose gradient
    is built only when it is trained).
    """
    b, t, d = hidden.shape
    n = t - 1
    chunk = min(chunk, n)
    pad = -n % chunk
    # [chunks, B, chunk, ...]: each block keeps the rows of the batch, so fsdp keeps splitting them.
    h = jnp.pad(hidden[:, :-1], ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d).swapaxes(0, 1)
    targets = jnp.pad(jnp.asarray(tokens, jnp.int32)[:, 1:], ((0, 0), (0, pad))).reshape(b, -1, chunk).swapaxes(0, 1)
    graphdef, state = nnx.split(model.embedder)
    softcap = getattr(model.config, "final_logit_softcap", None)
    vocab = state["input_embedding"].get_value().shape[0]
    slices = num_slices(vocab, vocab_slice)
    nll = _nll(h, targets, state, graphdef, softcap, slices, run_rows(vocab, slices, run), traced())
    return nll.swapaxes(0, 1).reshape(b, -1)[:, :n]
