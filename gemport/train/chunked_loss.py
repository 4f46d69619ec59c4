"""Cross-entropy from a Tunix Gemma's final hidden states and its tied embedding, in chunks of tokens.

Tunix's model returns float32 logits [B, T, V] (4 GiB per 4096-token row at Gemma's 262144-token vocabulary,
and as much again for their gradient). Here the logits of ``CHUNK`` tokens at a time are computed from the
hidden states (as Tunix's ``embedder.decode``, then Gemma 4's final softcap), a slice of the vocabulary at a
time with an online log-sum-exp, reduced to each target's negative log-likelihood and dropped; the backward
pass recomputes each slice's logits (a custom VJP), so memory holds one [chunk, slice] tile of logits, never
the row's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CHUNK = 1024
"""Tokens whose logits are computed at once."""

VOCAB_CHUNK = 16384
"""Vocabulary entries whose logits are computed at once: [CHUNK, VOCAB_CHUNK] float32 logits (64 MiB) and one
[VOCAB_CHUNK, D] slice of the embedding are live, never the [V, D] embedding in another dtype or layout."""


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


def _decode(h, w, dtype, softcap):
    # Tunix's Embedder.decode (Gemma 4 casts both to its compute dtype; Gemma 3 dots as they are), float32,
    # then the final softcap.
    if dtype is not None:
        h, w = h.astype(dtype), w.astype(dtype)
    logits = jnp.dot(h, w.T).astype(jnp.float32)
    return logits if softcap is None else jnp.tanh(logits / softcap) * softcap


def _vocab_blocks(w, vocab_chunk):
    vocab = w.shape[0]
    vocab_chunk = min(vocab_chunk, vocab)
    pad = -vocab % vocab_chunk
    return jnp.pad(w, ((0, pad), (0, 0))), vocab_chunk, (vocab + pad) // vocab_chunk


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunk_nll(h, targets, w, dtype, softcap, vocab_chunk):
    return _chunk_nll_value(h, targets, w, dtype, softcap, vocab_chunk)[0]


def _slice_logits(h, wp, j, vocab, vocab_chunk, dtype, softcap):
    w_j = jax.lax.dynamic_slice_in_dim(wp, j * vocab_chunk, vocab_chunk)
    logits = _decode(h, w_j, dtype, softcap)
    column = j * vocab_chunk + jnp.arange(vocab_chunk)
    return jnp.where(column < vocab, logits, -jnp.inf), column


def _chunk_nll_value(h, targets, w, dtype, softcap, vocab_chunk):
    vocab = w.shape[0]
    wp, vocab_chunk, blocks = _vocab_blocks(w, vocab_chunk)

    def block(carry, j):
        m, s, target = carry
        logits, column = _slice_logits(h, wp, j, vocab, vocab_chunk, dtype, softcap)
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
        target = target + jnp.where(column[None] == targets[:, None], logits, 0.0).sum(-1)
        return (m_new, s, target), None

    n = h.shape[0]
    init = (jnp.full(n, -jnp.inf, jnp.float32), jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.float32))
    (m, s, target), _ = jax.lax.scan(block, init, jnp.arange(blocks))
    lse = m + jnp.log(s)
    return lse - target, lse


def _chunk_nll_fwd(h, targets, w, dtype, softcap, vocab_chunk):
    # symbolic_zeros: each input says whether it is differentiated. A frozen embedding (LoRA) gets no
    # gradient computed, not a [V, D] one thrown away.
    nll, lse = _chunk_nll_value(h.value, targets.value, w.value, dtype, softcap, vocab_chunk)
    return nll, (h.value, targets.value, w.value, lse, (None,) if w.perturbed else ())


def _chunk_nll_bwd(dtype, softcap, vocab_chunk, residuals, d_nll):
    h, targets, w, lse, want_dw = residuals
    vocab = w.shape[0]
    wp, vocab_chunk, blocks = _vocab_blocks(w, vocab_chunk)

    def block(dh, j):
        w_j = jax.lax.dynamic_slice_in_dim(wp, j * vocab_chunk, vocab_chunk)
        logits, vjp = jax.vjp(lambda h, w_j: _decode(h, w_j, dtype, softcap), h, w_j)
        column = j * vocab_chunk + jnp.arange(vocab_chunk)
        p = jnp.where(column < vocab, jnp.exp(logits - lse[:, None]), 0.0)
        d_logits = d_nll[:, None] * (p - (column[None] == targets[:, None]))
        dh_j, dw_j = vjp(d_logits)
        return dh + dh_j, dw_j if want_dw else None

    dh, dw = jax.lax.scan(block, jnp.zeros(h.shape, h.dtype), jnp.arange(blocks))
    dw = dw.reshape(-1, w.shape[1])[:vocab].astype(w.dtype) if want_dw else None
    return dh, None, dw


_chunk_nll.defvjp(_chunk_nll_fwd, _chunk_nll_bwd, symbolic_zeros=True)


def target_nll(model: nnx.Module, hidden: jax.Array, tokens: jax.Array, *, chunk: int = CHUNK,
               vocab_chunk: int = VOCAB_CHUNK) -> jax.Array:
    """Next-token negative log-likelihoods from hidden states, [chunk, vocab_chunk] logits at a time.

    model: the Tunix Gemma whose tied embedding (``embedder.input_embedding`` [V, D], decoded as its
    ``embedder.decode`` does) and final logit softcap (if its config has one) turn hidden states into logits;
    hidden: [B, T, D] (``hidden_states``); tokens: int [B, T]. Position t predicts token t + 1, as
    ``masks.loss``. The log-sum-exp runs over vocabulary slices (an online softmax); the backward pass
    recomputes each slice's logits. Returns float32 [B, T - 1]: ``masks.loss``' per-target loss on Tunix's
    logits, with a float32 log-softmax.
    """
    b, t, d = hidden.shape
    n = b * (t - 1)
    chunk = min(chunk, n)
    pad = -n % chunk
    h = jnp.pad(hidden[:, :-1].reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
    targets = jnp.pad(jnp.asarray(tokens, jnp.int32)[:, 1:].reshape(n), (0, pad)).reshape(-1, chunk)
    embedder = model.embedder
    w = embedder.input_embedding[...]
    dtype = getattr(getattr(embedder, "config", None), "dtype", None)
    softcap = getattr(model.config, "final_logit_softcap", None)

    def step(carry, xs):
        return carry, _chunk_nll(*xs, w, dtype, softcap, vocab_chunk)

    _, nll = jax.lax.scan(step, None, (h, targets))
    return nll.reshape(-1)[:n].reshape(b, t - 1)
