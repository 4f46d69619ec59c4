"""Prepared examples on disk: a folder of flat ``.npy`` arrays and a manifest, read back by range.

The folder holds every kept example's tokens (int32 [N]) and target flags (bool [N]) end to end, where each
example starts (int64 [n + 1]) and its targets (int32 [n]), with ``packing`` TRL's packed rows (``order`` int64
[n], ``row_offsets`` int64 [rows + 1]: ``packing.Placement``), and ``manifest.json``: the counts, the truncation
report, the examples' digest and token id range, and what they were prepared from. ``Writer`` appends examples as
they are prepared and writes the manifest last; ``load`` opens the tokens and flags as ``Column``s, read by range as
batches ask for them, and holds one number per example (offsets, targets, packed order) in memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from gemport.errors import MaskError
from gemport.data.flat import Digest, FlatExamples
from gemport.data.packing import Placement
from gemport.data.truncation import TruncationReport

MANIFEST = "manifest.json"
"""The file written last: a folder without it is not a complete preparation."""

FORMAT = 1
"""The layout of a prepared folder and of the preparation that fills it; raised when either changes, so older
folders are prepared again rather than read."""

_HEADER = 128  # bytes of an .npy header written before the array's length is known, rewritten at the end
_BLOCK = 1 << 24  # elements a Column gathers scattered indices from at a time


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Prepared examples, read from their folder.

    Attributes:
      examples: the kept examples (``FlatExamples`` whose tokens and flags are ``Column``s on disk), in the data's
        order.
      placement: TRL's packed rows of them (``packing``), else None.
      report: what truncation at ``max_length`` cut or dropped (``TruncationReport``).
      path: the folder.
      manifest: ``manifest.json``'s content.
    """

    examples: FlatExamples
    placement: Placement | None
    report: TruncationReport
    path: Path
    manifest: dict[str, Any]


class Column:
    """A flat ``.npy`` array on disk whose ranges are read when indexed (``os.pread``): a batch reads its
    examples' bytes into fresh arrays, and nothing stays mapped into the process, so a run that reads every example
    once an epoch does not grow by the cache's size (a memory map's pages count in the reader's RSS once touched).

    ``column[i]`` and ``column[a:b]`` (step 1) read those elements; ``column[indices]`` (ints) reads the file in
    order, ``_BLOCK`` elements at a time; any other index, and ``np.asarray(column)``, map the whole array (for the
    rare pass over everything: naming a bad token id).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            header = (np.lib.format.read_array_header_1_0 if np.lib.format.read_magic(f) == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, _, dtype = header(f)
            self.start = f.tell()
        self.shape, self.dtype = shape, dtype
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self))
            count = max(stop - start, 0)
            data = os.pread(self.fd, count * self.dtype.itemsize, self.start + start * self.dtype.itemsize)
            return np.frombuffer(data, self.dtype, count)
        if isinstance(key, (int, np.integer)):
            i = range(len(self))[key]
            return self[i:i + 1][0]
        keys = np.asarray(key)
        if keys.dtype.kind not in "iu":
            return np.asarray(self)[key]
        # Gathered from the file read in order, a block at a time: scattered indices touch every page once,
        # and none stays in this process.
        keys = np.where(keys < 0, keys + len(self), keys).ravel()
        out = np.empty(len(keys), self.dtype)
        order = np.argsort(keys, kind="stable")
        wanted = keys[order]
        bounds = np.searchsorted(wanted, np.arange(0, len(self) + _BLOCK, _BLOCK))
        for block, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            if a < b:
                start = block * _BLOCK
                out[order[a:b]] = self[start:start + _BLOCK][wanted[a:b] - start]
        return out.reshape(np.shape(key))

    def __array__(self, dtype=None, copy=None):
        whole = np.load(self.path, mmap_mode="r")
        return whole if dtype is None else whole.astype(dtype)


class _Column:
    """One flat .npy array appended to piece by piece: a fixed-size header first, rewritten with the length at the
    end (``np.load`` reads any header padded with spaces)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self.file = open(path, "wb")
        self.file.write(b"\0" * _HEADER)

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, self.dtype).tobytes())
        self.count += len(values)

    def close(self) -> None:
        header = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                       "shape": (self.count,)})
        text = header.ljust(_HEADER - 10 - 1) + "\n"
        self.file.seek(0)
        self.file.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1"))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class Writer:
    """Fills a new folder with prepared examples, appended in the data's order, and finishes it with the packing
    and the manifest.

    Args:
      path: the folder (empty).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tokens = _Column(path / "tokens.npy", np.int32)
        self.loss_mask = _Column(path / "loss_mask.npy", bool)
        self.lengths: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.report = TruncationReport()
        self.digest = Digest()
        self.id_range: tuple[int, int] | None = None

    def append(self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, targets: np.ndarray,
               report: TruncationReport) -> None:
        """Adds consecutive examples: their tokens int32 [k_tokens] and loss_mask bool [k_tokens] end to end,
        lengths int [k], targets int [k] (``FlatExamples.targets``), and the ``TruncationReport`` of the records
        they came from."""
        self.tokens.append(tokens)
        self.loss_mask.append(loss_mask)
        lengths = np.asarray(lengths, np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        self.lengths.append(lengths)
        self.targets.append(np.asarray(targets, np.int32))
        for a, b in zip(starts.tolist(), ends.tolist()):
            self.digest.update(tokens[a:b], loss_mask[a:b])
        if len(tokens):
            low, high = int(tokens.min()), int(tokens.max())
            self.id_range = (low, high) if self.id_range is None else (min(low, self.id_range[0]),
                                                                      max(high, self.id_range[1]))
        self.report.merge(report)

    def finish(self, packing: Any, about: dict[str, Any]) -> None:
        """Closes the arrays, writes the offsets and targets, the packed rows ``packing(examples)`` returns (a
        ``Placement``; None without packing) and, last, the manifest with ``about`` (what the data was prepared
        from)."""
        self.tokens.close()
        self.loss_mask.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        np.save(self.path / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        np.save(self.path / "targets.npy", np.concatenate(self.targets) if self.targets else np.zeros(0, np.int32))
        manifest = {"format": FORMAT, "examples": len(lengths), "tokens": self.tokens.count,
                    "digest": self.digest.hexdigest(), "id_range": self.id_range, "report": self.report.to_json(),
                    "about": about}
        placement = packing(_examples(self.path, manifest))
        if placement is not None:
            np.save(self.path / "order.npy", placement.order)
            np.save(self.path / "row_offsets.npy", placement.row_offsets)
        manifest["rows"] = None if placement is None else placement.rows
        tmp = self.path / f".{MANIFEST}"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.path / MANIFEST)


def _examples(path: Path, manifest: dict[str, Any]) -> FlatExamples:
    # Tokens and flags read by range when a batch asks (Column); one number per example held in memory.
    id_range = manifest["id_range"]
    return FlatExamples(Column(path / "tokens.npy"), Column(path / "loss_mask.npy"), np.load(path / "offsets.npy"),
                        np.load(path / "targets.npy"), digest=manifest["digest"],
                        id_range=tuple(id_range) if id_range is not None else None)


def complete(path: Path) -> bool:
    """Whether ``path`` is a finished preparation of this ``FORMAT`` (its manifest written)."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def load(path: str | os.PathLike) -> Prepared:
    """The prepared examples of folder ``path``: tokens and flags read from disk as batches ask (``Column``).

    Raises:
      MaskError: the folder is not a complete preparation (no manifest: interrupted, or of another ``FORMAT``).
    """
    path = Path(path)
    if not complete(path):
        raise MaskError(f"{path}: not a complete gemport data preparation of format {FORMAT} (no {MANIFEST}); "
                        "delete it and run again to prepare the data anew")
    manifest = json.loads((path / MANIFEST).read_text())
    placement = None
    if manifest["rows"] is not None:
        placement = Placement(np.load(path / "order.npy"), np.load(path / "row_offsets.npy"))
    return Prepared(_examples(path, manifest), placement, TruncationReport.from_json(manifest["report"]), path,
                    manifest)


__all__ = ["Column", "FORMAT", "MANIFEST", "Prepared", "Writer", "complete", "load"]
