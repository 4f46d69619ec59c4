"""Examples one after another in flat arrays: what the prepared-data cache memory-maps and batches are built from.

A million conversations as a Python list of ``Example``s cost gigabytes and seconds to build; as three flat arrays
(every token, every target flag, where each example starts) they are a few numpy views, and on disk
(``prepared.Column``) they cost nothing until a batch reads its rows.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple, overload

import numpy as np

from gemport.data.packing import Labelled, labelled


class Stored(NamedTuple):
    """One example as batches take it (a ``Labelled``, ``Example``'s first two fields): tokens int32 [n],
    loss_mask bool [n] (``loss_mask[t]``: token t is a target)."""

    tokens: np.ndarray
    loss_mask: np.ndarray


class Digest:
    """sha256 of examples' tokens and loss masks, in order, fed one example at a time: the data as trained (after
    rendering, masks and truncation), the same on every process and whatever holds the examples."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, tokens: np.ndarray, loss_mask: np.ndarray) -> None:
        """Adds one example: tokens int [n], loss_mask bool [n]."""
        self._hash.update(len(tokens).to_bytes(8, "little"))
        self._hash.update(np.asarray(tokens).astype("<i4", copy=False).tobytes())
        self._hash.update(np.asarray(loss_mask).astype(bool, copy=False).tobytes())

    def hexdigest(self) -> str:
        """The hex digest of the examples added so far."""
        return self._hash.hexdigest()


def digest(examples: Iterable[Labelled]) -> str:
    """``Digest`` of ``examples`` (``Example``s or (tokens, loss_mask) pairs), in order."""
    h = Digest()
    for e in examples:
        h.update(e[0], e[1])
    return h.hexdigest()


class FlatExamples(Sequence[Stored]):
    """Examples laid end to end: example i is ``tokens[offsets[i]:offsets[i + 1]]`` with its ``loss_mask``.

    Args:
      tokens: int32 [N], every example's tokens one after another.
      loss_mask: bool [N], their target flags.
      offsets: int64 [n + 1], from 0 to N.
      targets: int [n], each example's targets after its first token (``loss_mask[1:].sum()``: what a row of it
        adds to HF's ``num_items_in_batch``, packed, padded or padding-free alike).
      digest: ``digest`` of the examples (``run.record`` names the data by it).
      id_range: (smallest, largest) token id, or None for no example.

    Indexing gives ``Stored`` views (a slice: a list of them); nothing is copied.
    """

    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, targets: np.ndarray, *,
                 digest: str, id_range: tuple[int, int] | None) -> None:
        self.tokens, self.loss_mask, self.offsets, self.targets = tokens, loss_mask, offsets, targets
        self.digest, self.id_range = digest, id_range

    @classmethod
    def of(cls, examples: Sequence[Labelled]) -> FlatExamples:
        """The examples of a list (``Example``s or (tokens, loss_mask) pairs) laid end to end, in memory."""
        tokens, loss_mask, lengths = labelled(examples, "FlatExamples.of")
        flat = np.concatenate(tokens).astype(np.int32, copy=False) if tokens else np.zeros(0, np.int32)
        mask = np.concatenate(loss_mask).astype(bool, copy=False) if loss_mask else np.zeros(0, bool)
        targets = np.fromiter((int(np.count_nonzero(m[1:])) for m in loss_mask), np.int64, len(loss_mask))
        return cls(flat, mask, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), targets,
                   digest=digest(zip(tokens, loss_mask)),
                   id_range=(int(flat.min()), int(flat.max())) if flat.size else None)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> Stored: ...

    @overload
    def __getitem__(self, i: slice) -> list[Stored]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, and an IndexError past the end
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        return Stored(self.tokens[start:stop], self.loss_mask[start:stop])

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Each example's tokens, int64 [n]."""
        return np.diff(self.offsets)


__all__ = ["Digest", "FlatExamples", "Stored", "digest"]
