"""Batching without packing: one example per row (padded), or TRL's padding-free layout.

Both return the ``Rows`` ``pack`` does (``tokens``, ``loss_mask``, ``segment_ids``, ``positions``), so
``tunix_inputs`` and the losses take them unchanged; ``stack`` lays a step's micro-batches out as its batch
[A, B, T]. Padding follows TRL's ``DataCollatorForLanguageModeling``:
on the right, with ``pad_id``, never a target.
"""

from collections.abc import Mapping, Sequence

import numpy as np

from gemport.errors import BatchError, MaskError
from gemport.data.packing import Labelled, Rows, _concatenate, labelled

BATCH_FIELDS: tuple[str, ...] = tuple(Rows.__annotations__)
"""The fields of a step's batch, each [A, B, T]: A micro-batches of B rows of T tokens (``data.Rows``' keys)."""


def _check_nonempty(lengths: np.ndarray, where: str) -> None:
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise MaskError(f"{where}: examples[{int(empty[0])}] is empty")


def _round_up(n: int, multiple: int | None) -> int:
    if multiple is None:
        return n
    if not (isinstance(multiple, int) and multiple >= 1):
        raise MaskError(f"pad_to_multiple_of: {multiple!r}; need a positive int or None")
    return -(-n // multiple) * multiple


def pad(examples: Sequence[Labelled], seq_len: int | None = None, *, pad_to_multiple_of: int | None = None,
        pad_id: int = 0) -> Rows:
    """One example per row, right-padded to ``seq_len`` or, with None, to the longest example.

    examples: ``Example``s or (tokens int [n_i], loss_mask bool [n_i]) pairs (``Example``'s target
    convention). pad_to_multiple_of: round the row length up, as TRL's ``pad_to_multiple_of``. Every n_i
    must fit (truncate first). Returns ``Rows`` [len(examples), T]: segment_ids 1 on the example, 0 on
    padding; positions 0.. on the example, 0 on padding. Rows stay in input order.
    """
    tokens, loss_mask, lengths = labelled(examples, "pad")
    _check_nonempty(lengths, "pad")
    longest = int(lengths.max(initial=0))
    width = _round_up(longest if seq_len is None else seq_len, pad_to_multiple_of)
    if longest > width:
        i = int(np.argmax(lengths))
        raise MaskError(f"pad: examples[{i}] has {longest} tokens for rows of {width} (truncate first)")
    real = np.arange(width)[None, :] < lengths[:, None]
    out = Rows(tokens=np.full(real.shape, pad_id, np.int32), loss_mask=np.zeros(real.shape, bool),
               segment_ids=real.astype(np.int32),
               positions=np.where(real, np.arange(width, dtype=np.int32)[None, :], 0).astype(np.int32))
    out["tokens"][real] = _concatenate(tokens, np.int32)
    out["loss_mask"][real] = _concatenate(loss_mask, bool)
    return out


def padding_free(examples: Sequence[Labelled], *, pad_to_multiple_of: int | None = None, pad_id: int = 0) -> Rows:
    """TRL's padding-free layout: all examples concatenated into one row, in input order.

    ``positions`` restart at 0 for each example and ``segment_ids`` count the examples from 1, so
    attention stays within an example, as the varlen kernels do with TRL's ``position_ids``; the
    first token of each example is never a target (TRL sets its label to -100). Takes ``pad``'s
    examples; returns ``Rows`` [1, T], T the total length rounded up to ``pad_to_multiple_of``.
    """
    tokens, loss_mask, lengths = labelled(examples, "padding_free")
    _check_nonempty(lengths, "padding_free")
    total = int(lengths.sum())
    width = _round_up(total, pad_to_multiple_of)
    starts = np.cumsum(lengths) - lengths
    flat_mask = _concatenate(loss_mask, bool)
    flat_mask[starts] = False
    out = Rows(tokens=np.full((1, width), pad_id, np.int32), loss_mask=np.zeros((1, width), bool),
               segment_ids=np.zeros((1, width), np.int32), positions=np.zeros((1, width), np.int32))
    out["tokens"][0, :total] = _concatenate(tokens, np.int32)
    out["loss_mask"][0, :total] = flat_mask
    out["segment_ids"][0, :total] = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
    out["positions"][0, :total] = np.arange(total, dtype=np.int32) - np.repeat(starts, lengths).astype(np.int32)
    return out


def stack(micro_batches: Sequence[Mapping[str, np.ndarray]], *, accumulation: int | None = None,
          rows: int | None = None) -> dict[str, np.ndarray]:
    """A step's batch [A, B, T] from its micro-batches, each a dict of ``BATCH_FIELDS`` [b_i, T].

    accumulation: A, at least the number of micro-batches (default: that number); rows: B, at least
    every b_i (default: the largest). Missing rows and micro-batches are filled with empty ones
    (padding, no target), which change neither the loss nor the gradient: so the last, shorter
    step of an epoch keeps the shape of the others and the step is not compiled again.
    """
    if not micro_batches:
        raise BatchError("stack: no micro-batch")
    widths = {np.shape(m["tokens"])[1] for m in micro_batches}
    if len(widths) != 1:
        raise BatchError(f"stack: micro-batches of different lengths {sorted(widths)}; pad them to one")
    accumulation = len(micro_batches) if accumulation is None else accumulation
    rows = max(len(m["tokens"]) for m in micro_batches) if rows is None else rows
    if accumulation < len(micro_batches) or rows < max(len(m["tokens"]) for m in micro_batches):
        raise BatchError(
            f"stack: {len(micro_batches)} micro-batches of up to {max(len(m['tokens']) for m in micro_batches)} "
            f"rows do not fit accumulation={accumulation}, rows={rows}"
        )
    (width,) = widths
    out = {}
    for k in BATCH_FIELDS:
        dtype = bool if k == "loss_mask" else np.int32
        out[k] = np.zeros((accumulation, rows, width), dtype)
        for i, m in enumerate(micro_batches):
            out[k][i, : len(m[k])] = m[k]
    return out
