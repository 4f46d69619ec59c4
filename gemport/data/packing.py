"""Best-fit-decreasing packing into fixed-length rows, and the inputs Tunix takes.

Rows follow Grain's packing conventions: ``segment_ids`` are 1-based per example within a row with
0 for padding, ``positions`` restart at 0 for every example (and are 0 on padding).
"""

import bisect
import collections
from collections.abc import Sequence
from typing import NamedTuple, TypedDict

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


class Placement(NamedTuple):
    """Where packing puts each example: row r holds examples ``order[row_offsets[r]:row_offsets[r + 1]]``, in that
    order from its first token.

    order: int64 [n], every example index once, row by row; row_offsets: int64 [rows + 1], from 0 to n.
    """

    order: np.ndarray
    row_offsets: np.ndarray

    @property
    def rows(self) -> int:
        """The number of packed rows."""
        return len(self.row_offsets) - 1


TRL_PACKING_BATCH = 1000
"""Examples per call of TRL's ``_pack_bfd``: ``pack_dataset`` packs through ``datasets``' ``map(batched=True)``,
whose default ``batch_size`` is 1000 (``Dataset.map`` and ``IterableDataset.map`` alike)."""


def best_fit(lengths: np.ndarray, seq_len: int) -> Placement:
    """Best fit decreasing of examples of ``lengths`` (int [n], each 1..seq_len) into rows of ``seq_len``: longest
    first (ties in input order), each into the open row it fills most tightly (the oldest such row), as TRL's
    ``_pack_bfd``; returns the ``Placement``."""
    row, offset, rows = _best_fit_decreasing(np.asarray(lengths, np.int64), seq_len)
    order = np.lexsort((offset, row))
    return Placement(order, np.concatenate([[0], np.cumsum(np.bincount(row, minlength=rows))]).astype(np.int64))


def trl_placement(lengths: np.ndarray, seq_len: int, *, num_proc: int | None = None,
                  batch: int = TRL_PACKING_BATCH) -> Placement:
    """The ``Placement`` of TRL's ``pack_dataset(..., "bfd")`` over examples of ``lengths`` (int [n]).

    TRL packs in ``datasets.map`` batches: ``batch`` consecutive examples at a time (``best_fit`` of each), within
    each of the ``num_proc`` contiguous shards ``datasets`` cuts the dataset into for ``SFTConfig.dataset_num_proc``
    (``Dataset.shard(contiguous=True)``: the first ``n % num_proc`` shards one example longer); the rows of each
    batch follow those of the one before. Packing the whole dataset at once (``best_fit``) gives other rows as soon
    as it holds more than ``batch`` examples.

    Args:
      lengths: each example's tokens, int [n].
      seq_len: the rows' length (``max_length``).
      num_proc: ``dataset_num_proc`` (None: one shard; ``datasets`` caps it at n).
      batch: examples per packing call (``datasets``' default batch size).

    Returns:
      The ``Placement`` of every example, rows in TRL's order.
    """
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    shards = max(1, min(num_proc or 1, n))
    size, longer = divmod(n, shards)
    orders, counts, start = [], [], 0
    for shard in range(shards):
        stop = start + size + (shard < longer)
        for first in range(start, stop, batch):
            part = best_fit(lengths[first:min(first + batch, stop)], seq_len)
            orders.append(part.order + first)
            counts.append(np.diff(part.row_offsets))
        start = stop
    counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    return Placement(np.concatenate(orders) if orders else np.zeros(0, np.int64),
                     np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def packed_rows(examples: Sequence[Labelled], placement: Placement, rows: Sequence[int] | np.ndarray,
                seq_len: int) -> Rows:
    """``Rows`` [len(rows), seq_len] of the placement's rows ``rows`` (int indices), each its examples one after
    another from its first token, then padding (token 0, never trained); ``segment_ids`` count the row's examples
    from 1, ``positions`` restart at 0 for each.

    examples: every example ``placement`` places (``Example``s, or (tokens, loss_mask) pairs).
    """
    rows = np.asarray(rows, np.int64)
    starts, stops = placement.row_offsets[rows], placement.row_offsets[rows + 1]
    per_row = stops - starts
    placed = np.concatenate([placement.order[a:b] for a, b in zip(starts.tolist(), stops.tolist())]) \
        if len(rows) else np.zeros(0, np.int64)
    picked = [examples[int(i)] for i in placed]
    lengths = np.fromiter((len(e[0]) for e in picked), np.int64, len(picked))
    row = np.repeat(np.arange(len(rows)), per_row)
    offset = np.cumsum(lengths) - lengths
    offset -= np.repeat(offset[np.cumsum(per_row) - per_row], per_row) if len(picked) else 0
    column = np.arange(seq_len, dtype=np.int32)
    padding = column >= np.bincount(row, weights=lengths, minlength=len(rows))[:, None]
    shape = (len(rows), seq_len)
    out = Rows(tokens=np.zeros(shape, np.int32), loss_mask=np.zeros(shape, bool),
               segment_ids=np.zeros(shape, np.int32), positions=np.zeros(shape, np.int32))
    out["tokens"][~padding] = _concatenate([e[0] for e in picked], np.int32)
    out["loss_mask"][~padding] = _concatenate([e[1] for e in picked], bool)
    out["positions"][~padding] = _concatenate([column[:n] for n in lengths.tolist()], np.int32)
    # Segment ids count the example starts met so far in the row.
    starts_here = np.zeros(shape, np.int32)
    starts_here[row, offset] = 1
    out["segment_ids"] = np.cumsum(starts_here, axis=1, dtype=np.int32)
    out["segment_ids"][padding] = 0
    return out


def check_packable(lengths: np.ndarray, first_trained: np.ndarray, seq_len: int, where: str) -> None:
    """MaskError naming the first example packing cannot take: lengths int [n] not 1..seq_len (truncate first), or
    first_trained bool [n] set (trained on its first token, which, packed, would be predicted from the example
    before it)."""
    bad = np.flatnonzero((lengths < 1) | (lengths > seq_len))
    if bad.size:
        i = int(bad[0])
        raise MaskError(f"{where}: examples[{i}] has {lengths[i]} tokens; need 1..{seq_len} (truncate first)")
    trained = np.flatnonzero(first_trained)
    if trained.size:
        raise MaskError(f"{where}: examples[{int(trained[0])}]: loss_mask[0] is True; the first token of an "
                        "example has nothing before it to be predicted from")


def pack(examples: Sequence[Labelled], seq_len: int) -> Rows:
    """Packs examples into rows of ``seq_len`` tokens, best fit decreasing.

    examples: ``Example``s or (tokens int [n_i], loss_mask bool [n_i]) pairs, with every
    1 <= n_i <= seq_len (truncate first) and ``loss_mask[0]`` False, so the first token of a segment
    is never a target predicted from the previous one. Examples are placed longest first (ties in
    input order), each into the open row it fills most tightly (the oldest such row): the rows of one call of
    TRL's ``packing_strategy="bfd"`` packer, in the same order (TRL packs 1000 examples at a time:
    ``trl_placement``). Returns ``Rows`` [rows, seq_len]; padding is token 0, never trained.
    """
    tokens, loss_mask, lengths = labelled(examples, "pack")
    check_packable(lengths, np.array([bool(m[0]) if len(m) else False for m in loss_mask], bool), seq_len, "pack")
    placement = best_fit(lengths, seq_len)
    return packed_rows(list(zip(tokens, loss_mask)), placement, np.arange(placement.rows), seq_len)


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
