"""Best-fit-decreasing packing into fixed-length rows, and the inputs Tunix takes.

Rows follow Grain's packing conventions: ``segment_ids`` are 1-based per example within a row with
0 for padding, ``positions`` restart at 0 for every example (and are 0 on padding).
"""

import bisect
import collections
from collections.abc import Sequence
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from gemport.errors import MaskError
from gemport.data.tokenize import Example

Labelled = Example | tuple[np.ndarray, np.ndarray]
"""One example to batch: an ``Example`` or a ``(tokens, loss_mask)`` pair (int [n], bool [n]), the
target convention of ``Example``; both are tuples that start with those two arrays."""


class Rows(TypedDict):
    """Examples laid out in rows, each array [rows, T], as ``pack``, ``pad`` and ``padding_free`` return them.

    tokens: int32, padding ``pad_id``; loss_mask: bool targets, never on padding; segment_ids: int32,
    1.. per example within a row, 0 on padding; positions: int32, from 0 in each example, 0 on padding.
    A dict (typed for readers and checkers) because its consumers take keywords: ``tunix_inputs(**rows)``,
    Tunix's ``PeftTrainer`` loss (``loss_fn(model, **batch)``) and Grain's records.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


def labelled(examples: Sequence[Labelled], where: str) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The tokens and loss masks of ``examples`` as two lists, and the lengths int64 [len(examples)];
    MaskError naming the first example that is not a ``Labelled`` or whose mask and tokens differ in length."""
    if not all(isinstance(example, tuple) and len(example) >= 2 for example in examples):
        i, example = next((i, e) for i, e in enumerate(examples) if not (isinstance(e, tuple) and len(e) >= 2))
        raise MaskError(f"{where}: examples[{i}] is a {type(example).__name__}; pass Examples or (tokens, loss_mask) pairs")
    tokens = [example[0] for example in examples]
    loss_mask = [example[1] for example in examples]
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    mask_lengths = np.fromiter(map(len, loss_mask), np.int64, len(loss_mask))
    mismatched = np.flatnonzero(mask_lengths != lengths)
    if mismatched.size:
        i = int(mismatched[0])
        raise MaskError(f"{where}: examples[{i}]: loss_mask has {mask_lengths[i]} entries for {lengths[i]} tokens")
    return tokens, loss_mask, lengths


def pack(examples: Sequence[Labelled], seq_len: int) -> Rows:
    """Packs examples into rows of ``seq_len`` tokens, best fit decreasing.

    examples: ``Example``s or (tokens int [n_i], loss_mask bool [n_i]) pairs, with every
    1 <= n_i <= seq_len (truncate first) and ``loss_mask[0]`` False, so the first token of a segment
    is never a target predicted from the previous one. Examples are placed longest first (ties in
    input order), each into the open row it fills most tightly (the oldest such row): the rows of
    TRL's ``packing_strategy="bfd"``, in the same order. Returns ``Rows`` [rows, seq_len]; padding is
    token 0, never trained.
    """
    tokens, loss_mask, lengths = labelled(examples, "pack")
    bad = np.flatnonzero((lengths < 1) | (lengths > seq_len))
    if bad.size:
        i = int(bad[0])
        raise MaskError(f"pack: examples[{i}] has {lengths[i]} tokens; need 1..{seq_len} (truncate first)")
    row, offset, rows = _best_fit_decreasing(lengths, seq_len)
    # Laid out row by row, the packed tokens are the examples concatenated in (row, offset) order.
    placed = np.lexsort((offset, row))
    placed_lengths = lengths[placed]
    starts = np.cumsum(placed_lengths) - placed_lengths
    flat_mask = _concatenate([loss_mask[i] for i in placed], bool)
    first_trained = np.flatnonzero(flat_mask[starts])
    if first_trained.size:
        raise MaskError(
            f"pack: examples[{int(placed[first_trained[0]])}]: loss_mask[0] is True; the first token of an "
            "example has nothing before it to be predicted from"
        )
    column = np.arange(seq_len, dtype=np.int32)
    padding = column >= np.bincount(row, weights=lengths, minlength=rows)[:, None]
    out = Rows(tokens=np.zeros((rows, seq_len), np.int32), loss_mask=np.zeros((rows, seq_len), bool),
               segment_ids=np.zeros((rows, seq_len), np.int32), positions=np.zeros((rows, seq_len), np.int32))
    out["tokens"][~padding] = _concatenate([tokens[i] for i in placed], np.int32)
    out["loss_mask"][~padding] = flat_mask
    out["positions"][~padding] = _concatenate([column[:n] for n in placed_lengths.tolist()], np.int32)
    # Segment ids count the example starts met so far in the row.
    starts_here = np.zeros((rows, seq_len), np.int32)
    starts_here[row, offset] = 1
    out["segment_ids"] = np.cumsum(starts_here, axis=1, dtype=np.int32)
    out["segment_ids"][padding] = 0
    return out


def _concatenate(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
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


def attention_mask(segment_ids: jax.typing.ArrayLike) -> jax.Array:
    """Causal, block-diagonal attention: bool [B, T, T] from segment_ids int [B, T].

    Query t sees key s when s <= t and both carry the same segment id. Padding (segment 0) sees
    earlier padding only, so no attention row is empty; padding is never a target.
    """
    segment_ids = jnp.asarray(segment_ids)
    seq_len = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    return (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal


def tunix_inputs(tokens: jax.typing.ArrayLike, loss_mask: jax.typing.ArrayLike, segment_ids: jax.typing.ArrayLike,
                 positions: jax.typing.ArrayLike) -> dict[str, jax.Array]:
    """The keyword arguments of Tunix's default PEFT loss for packed rows.

    tokens, segment_ids, positions: int [B, T]; loss_mask: bool [B, T] (targets). Returns
    {"input_tokens": int32 [B, T], "input_mask": bool [B, T], "positions": int32 [B, T],
    "attention_mask": bool [B, T, T]}. Tunix scores ``input_tokens[:, 1:]`` where
    ``input_mask[:, 1:]``, the same target convention. Tunix's examples derive positions and
    attention from a padding mask, which lets packed examples see each other; these come from
    ``segment_ids`` instead. Use it as the trainer's ``gen_model_input_fn``
    (``lambda batch: tunix_inputs(**batch)`` on ``Rows``); it is jittable.
    """
    return {
        "input_tokens": jnp.asarray(tokens, jnp.int32),
        "input_mask": jnp.asarray(loss_mask, bool),
        "positions": jnp.asarray(positions, jnp.int32),
        "attention_mask": attention_mask(segment_ids),
    }
