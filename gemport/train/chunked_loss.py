"""Cross-entropy from a Tunix Gemma's final hidden states and its tied embedding, in chunks of tokens.

Tunix's model returns float32 logits [B, T, V] (4 GiB per 4096-token row at Gemma's 262144-token vocabulary,
and as much again for their gradient). Here the logits of ``CHUNK`` tokens at a time are computed from the
hidden states (Tunix's ``embedder.decode``, then Gemma 4's final softcap), reduced to each target's negative
log-likelihood and dropped; the backward pass recomputes each chunk's logits (``jax.checkpoint``), so memory
holds one chunk's logits, never the row's.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

CHUNK = 512
"""Tokens whose logits [CHUNK, V] are held at once (1 GiB of float32 at V = 262144, gradient included)."""


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


def target_nll(model: nnx.Module, hidden: jax.Array, tokens: jax.Array, *, chunk: int = CHUNK) -> jax.Array:
    """Next-token negative log-likelihoods from hidden states, ``chunk`` tokens' logits at a time.

    model: the Tunix Gemma whose ``embedder`` (and final logit softcap, if its config has one) turn hidden
    states into logits; hidden: [B, T, D] (``hidden_states``); tokens: int [B, T]. Position t predicts token
    t + 1, as ``masks.loss``. Returns float32 [B, T - 1]: the value of ``masks.loss``' per-target loss on
    Tunix's logits, with float32 log-softmax.
    """
    b, t, d = hidden.shape
    n = b * (t - 1)
    chunk = min(chunk, n)
    pad = -n % chunk
    h = jnp.pad(hidden[:, :-1].reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
    targets = jnp.pad(jnp.asarray(tokens, jnp.int32)[:, 1:].reshape(n), (0, pad)).reshape(-1, chunk)
    graphdef, state = nnx.split(model.embedder)
    softcap = getattr(model.config, "final_logit_softcap", None)

    @jax.checkpoint
    def chunk_nll(h_c, t_c, state):
        logits = nnx.merge(graphdef, state).decode(h_c).astype(jnp.float32)
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t_c[:, None], -1)[:, 0]

    _, nll = jax.lax.scan(lambda carry, xs: (carry, chunk_nll(*xs, state)), None, (h, targets))
    return nll.reshape(-1)[:n].reshape(b, t - 1)
