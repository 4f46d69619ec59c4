"""Batching without packing: one example per row (padded), or TRL's padding-free layout.

Both produce the fields ``pack`` does (``tokens``, ``loss_mask``, ``segment_ids``, ``positions``), so
``tunix_inputs`` and the losses take them unchanged. Padding follows TRL's ``DataCollatorForLanguageModeling``:
on the right, with ``pad_id``, never a target.
"""

import numpy as np

from gemport.errors import MaskError
from gemport.masks.packing import _concatenate


def _check(tokens, loss_mask, where):
    if len(tokens) != len(loss_mask):
        raise MaskError(f"{where}: {len(tokens)} token arrays but {len(loss_mask)} loss masks")
    lengths = np.array(list(map(len, tokens)), dtype=np.int64)
    for i, (t, m) in enumerate(zip(tokens, loss_mask)):
        if len(m) != len(t):
            raise MaskError(f"{where}: loss_mask[{i}] has {len(m)} entries for {len(t)} tokens")
        if len(t) == 0:
            raise MaskError(f"{where}: example {i} is empty")
    return lengths


def _round_up(n, multiple):
    if multiple is None:
        return n
    if not (isinstance(multiple, int) and multiple >= 1):
        raise MaskError(f"pad_to_multiple_of: {multiple!r}; need a positive int or None")
    return -(-n // multiple) * multiple


def pad(tokens, loss_mask, seq_len=None, *, pad_to_multiple_of=None, pad_id=0):
    """One example per row, right-padded to ``seq_len`` or, with None, to the longest example.

    tokens: sequence of int [n_i]; loss_mask: sequence of bool [n_i] (``Example``'s target convention).
    pad_to_multiple_of: round the row length up, as TRL's ``pad_to_multiple_of``. Every n_i must fit
    (truncate first). Returns a dict of [len(tokens), T] arrays: "tokens" int32, "loss_mask" bool,
    "segment_ids" int32 (1 on the example, 0 on padding), "positions" int32 (0.. on the example,
    0 on padding). Rows stay in input order.
    """
    lengths = _check(tokens, loss_mask, "pad")
    longest = int(lengths.max(initial=0))
    width = _round_up(longest if seq_len is None else seq_len, pad_to_multiple_of)
    if longest > width:
        i = int(np.argmax(lengths))
        raise MaskError(f"pad: example {i} has {longest} tokens for rows of {width} (truncate first)")
    real = np.arange(width)[None, :] < lengths[:, None]
    out = {"tokens": np.full(real.shape, pad_id, np.int32), "loss_mask": np.zeros(real.shape, bool)}
    out["tokens"][real] = _concatenate(list(tokens), np.int32)
    out["loss_mask"][real] = _concatenate(list(loss_mask), bool)
    out["segment_ids"] = real.astype(np.int32)
    out["positions"] = np.where(real, np.arange(width, dtype=np.int32)[None, :], 0).astype(np.int32)
    return out


def padding_free(tokens, loss_mask, *, pad_to_multiple_of=None, pad_id=0):
    """TRL's padding-free layout: all examples concatenated into one row, in input order.

    ``positions`` restart at 0 for each example and ``segment_ids`` count the examples from 1, so
    attention stays within an example, as the varlen kernels do with TRL's ``position_ids``; the
    first token of each example is never a target (TRL sets its label to -100). Returns the dict of
    ``pad`` with arrays of shape [1, T], T the total length rounded up to ``pad_to_multiple_of``.
    """
    lengths = _check(tokens, loss_mask, "padding_free")
    total = int(lengths.sum())
    width = _round_up(total, pad_to_multiple_of)
    starts = np.cumsum(lengths) - lengths
    flat_mask = _concatenate(list(loss_mask), bool)
    flat_mask[starts] = False
    out = {
        "tokens": np.full((1, width), pad_id, np.int32),
        "loss_mask": np.zeros((1, width), bool),
        "segment_ids": np.zeros((1, width), np.int32),
        "positions": np.zeros((1, width), np.int32),
    }
    out["tokens"][0, :total] = _concatenate(list(tokens), np.int32)
    out["loss_mask"][0, :total] = flat_mask
    out["segment_ids"][0, :total] = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
    out["positions"][0, :total] = np.arange(total, dtype=np.int32) - np.repeat(starts, lengths).astype(np.int32)
    return out
