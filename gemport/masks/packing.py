"""Best-fit-decreasing packing into fixed-length rows, and the inputs Tunix takes.

Rows follow Grain's packing conventions: ``segment_ids`` are 1-based per example within a row with
0 for padding, ``positions`` restart at 0 for every example (and are 0 on padding).
"""

import bisect
import collections

import jax.numpy as jnp
import numpy as np

from gemport.errors import MaskError


def pack(tokens, loss_mask, seq_len):
    """Packs examples into rows of ``seq_len`` tokens, best fit decreasing.

    tokens: sequence of int [n_i]; loss_mask: sequence of bool [n_i] (the target convention of
    ``Example``); every 1 <= n_i <= seq_len (truncate first) and ``loss_mask[i][0]`` False, so the
    first token of a segment is never a target predicted from the previous one. Examples are
    placed longest first (ties in input order), each into the open row it fills most tightly (the
    oldest such row): the rows of TRL's ``packing_strategy="bfd"``, in the same order.
    Returns a dict of [rows, seq_len] arrays: "tokens" int32, "loss_mask" bool, "segment_ids"
    int32, "positions" int32. Padding is token 0, never trained.
    """
    if len(tokens) != len(loss_mask):
        raise MaskError(f"pack: {len(tokens)} token arrays but {len(loss_mask)} loss masks")
    lengths = np.array(list(map(len, tokens)), dtype=np.int64)
    mask_lengths = np.array(list(map(len, loss_mask)), dtype=np.int64)
    mismatched = np.flatnonzero(mask_lengths != lengths)
    if mismatched.size:
        i = int(mismatched[0])
        raise MaskError(f"pack: loss_mask[{i}] has {mask_lengths[i]} entries for {lengths[i]} tokens")
    bad = np.flatnonzero((lengths < 1) | (lengths > seq_len))
    if bad.size:
        i = int(bad[0])
        raise MaskError(f"pack: example {i} has {lengths[i]} tokens; need 1..{seq_len} (truncate first)")
    row, offset, rows = _best_fit_decreasing(lengths, seq_len)
    # Laid out row by row, the packed tokens are the examples concatenated in (row, offset) order.
    placed = np.lexsort((offset, row))
    placed_lengths = lengths[placed]
    starts = np.cumsum(placed_lengths) - placed_lengths
    flat_mask = _concatenate([loss_mask[i] for i in placed], bool)
    first_trained = np.flatnonzero(flat_mask[starts])
    if first_trained.size:
        raise MaskError(
            f"pack: loss_mask[{int(placed[first_trained[0]])}][0] is True; the first token of an example "
            "has nothing before it to be predicted from"
        )
    column = np.arange(seq_len, dtype=np.int32)
    padding = column >= np.bincount(row, weights=lengths, minlength=rows)[:, None]
    out = {"tokens": np.zeros((rows, seq_len), np.int32), "loss_mask": np.zeros((rows, seq_len), bool)}
    out["tokens"][~padding] = _concatenate([tokens[i] for i in placed], np.int32)
    out["loss_mask"][~padding] = flat_mask
    out["positions"] = np.zeros((rows, seq_len), np.int32)
    out["positions"][~padding] = _concatenate([column[:n] for n in placed_lengths.tolist()], np.int32)
    # Segment ids count the example starts met so far in the row.
    starts_here = np.zeros((rows, seq_len), np.int32)
    starts_here[row, offset] = 1
    out["segment_ids"] = np.cumsum(starts_here, axis=1, dtype=np.int32)
    out["segment_ids"][padding] = 0
    return out


def _concatenate(arrays, dtype):
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _best_fit_decreasing(lengths, seq_len):
    # Open rows are bucketed by free space; `free` lists the non-empty bucket sizes in order, so
    # the tightest row that fits is one bisect away. Among rows with the same free space the oldest
    # is filled first, as TRL's packer does, so the rows are TRL's.
    n = len(lengths)
    row, offset = [0] * n, [0] * n
    filled, buckets, free = [], {}, []
    sizes = lengths.tolist()
    for i in np.argsort(-lengths, kind="stable").tolist():
        length = sizes[i]
        k = bisect.bisect_left(free, length)
        if k == len(free):
            r = len(filled)
            filled.append(0)
        else:
            space = free[k]
            r = buckets[space].popleft()
            if not buckets[space]:
                del buckets[space]
                free.pop(k)
        row[i], offset[i] = r, filled[r]
        filled[r] += length
        space = seq_len - filled[r]
        if space:
            if space not in buckets:
                buckets[space] = collections.deque()
                bisect.insort(free, space)
            buckets[space].append(r)
    return np.array(row, np.int64), np.array(offset, np.int64), len(filled)


def attention_mask(segment_ids):
    """Causal, block-diagonal attention: bool [B, T, T] from segment_ids int [B, T].

    Query t sees key s when s <= t and both carry the same segment id. Padding (segment 0) sees
    earlier padding only, so no attention row is empty; padding is never a target.
    """
    segment_ids = jnp.asarray(segment_ids)
    seq_len = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    return (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal


def tunix_inputs(tokens, loss_mask, segment_ids, positions):
    """The keyword arguments of Tunix's default PEFT loss for packed rows.

    tokens, segment_ids, positions: int [B, T]; loss_mask: bool [B, T] (targets). Returns
    {"input_tokens": int32 [B, T], "input_mask": bool [B, T], "positions": int32 [B, T],
    "attention_mask": bool [B, T, T]}. Tunix scores ``input_tokens[:, 1:]`` where
    ``input_mask[:, 1:]``, the same target convention. Tunix's examples derive positions and
    attention from a padding mask, which lets packed examples see each other; these come from
    ``segment_ids`` instead. Use it as the trainer's ``gen_model_input_fn``
    (``lambda batch: tunix_inputs(**batch)`` on ``pack``'s rows); it is jittable.
    """
    return {
        "input_tokens": jnp.asarray(tokens, jnp.int32),
        "input_mask": jnp.asarray(loss_mask, bool),
        "positions": jnp.asarray(positions, jnp.int32),
        "attention_mask": attention_mask(segment_ids),
    }
