"""Cross-entropy with an explicit scope: which targets a reported loss averages over."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def next_token_nll(logits: ArrayLike, tokens: ArrayLike) -> jax.Array:
    """Per-target losses float32 [B, T - 1] from logits [B, T, V] and tokens int [B, T]: position t's loss of
    token t + 1."""
    # Position t predicts token t + 1; the float32 log-softmax keeps bf16 logits from skewing the mean.
    log_probs = jax.nn.log_softmax(jnp.asarray(logits[:, :-1], jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]


def _mean(nll: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    count = targets.sum()
    return jnp.where(targets, nll, 0.0).sum() / jnp.maximum(count, 1), count


def masked_cross_entropy(logits: ArrayLike, tokens: ArrayLike, loss_mask: ArrayLike) -> jax.Array:
    """Mean next-token cross-entropy over the trained targets.

    logits: float [B, T, V]; tokens: int [B, T]; loss_mask: bool [B, T], ``loss_mask[b, t]`` saying
    token t is a target predicted at t - 1 (column 0 is ignored). Normalised by the number of
    targets in the batch, not per row. Returns float32 []; 0 when there is no target.
    """
    return _mean(next_token_nll(logits, tokens), jnp.asarray(loss_mask, bool)[:, 1:])[0]


def summed_cross_entropy(logits: ArrayLike, tokens: ArrayLike, loss_mask: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over the trained targets, and their count.

    The shapes and target convention of ``masked_cross_entropy``. Returns (float32 [], int32 []):
    the sum of the targets' negative log-likelihoods (what HF's Trainer sums per micro-batch before
    dividing by the targets of the whole accumulated batch) and the number of targets.
    """
    targets = jnp.asarray(loss_mask, bool)[:, 1:]
    return jnp.where(targets, next_token_nll(logits, tokens), 0.0).sum(), targets.sum(dtype=jnp.int32)


def loss_scopes(logits: ArrayLike, tokens: ArrayLike, loss_mask: ArrayLike,
                segment_ids: ArrayLike) -> dict[str, jax.Array]:
    """The masked and the full-sequence loss side by side, from the same logits.

    logits: float [B, T, V]; tokens: int [B, T]; loss_mask: bool [B, T]; segment_ids: int [B, T]
    (``pack``'s, or an unpacked batch's padding mask as 0/1). "masked" is the loss the policy
    trains (assistant-only under the default policy); "full_sequence" scores every token that
    follows a token of its own segment (what a run without masks reports), so packed neighbours
    and padding never count. Returns {"masked": float32 [], "full_sequence": float32 [],
    "masked_targets": int32 [], "full_sequence_targets": int32 []}.
    """
    return nll_scopes(next_token_nll(logits, tokens), loss_mask, segment_ids)


def nll_scopes(nll: ArrayLike, loss_mask: ArrayLike, segment_ids: ArrayLike) -> dict[str, jax.Array]:
    """``loss_scopes`` from the per-target losses: nll float32 [B, T - 1], position t's loss of token t + 1
    (e.g. ``step.chunked_loss.target_nll``); loss_mask, segment_ids [B, T] and the result as there."""
    nll = jnp.asarray(nll)
    segment_ids = jnp.asarray(segment_ids)
    same_segment = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    masked, masked_targets = _mean(nll, jnp.asarray(loss_mask, bool)[:, 1:])
    full, full_targets = _mean(nll, same_segment)
    return {
        "masked": masked,
        "full_sequence": full,
        "masked_targets": masked_targets.astype(jnp.int32),
        "full_sequence_targets": full_targets.astype(jnp.int32),
    }
