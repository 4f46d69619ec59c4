"""Batching without packing: one example per row (padded), or TRL's padding-free layout.

Both return the ``Rows`` ``pack`` does (``tokens``, ``loss_mask``, ``segment_ids``, ``positions``), so
``tunix_inputs`` and the losses take them unchanged. Padding follows TRL's ``DataCollatorForLanguageModeling``:
on the right, with ``pad_id``, never a target.
"""

from collections.abc import Sequence

import numpy as np

from gemport.errors import MaskError
from gemport.masks.packing import Labelled, Rows, _concatenate, labelled


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
