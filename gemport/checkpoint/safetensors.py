"""A strict, streaming safetensors reader and writer.

Reading reads one tensor at a time into a fresh buffer with plain file reads: unlike a memory map, the
page cache never counts toward the process's memory, so a load costs what it keeps plus one tensor. Writing takes tensors lazily, one at a time, after a header
computed from their declared dtypes and shapes: peak memory is one tensor. Untouched tensors can be copied
as raw bytes without being decoded.

Format: 8-byte little-endian header length N, N bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then the data;
offsets are relative to the end of the header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np

from gemport.errors import CheckpointError, CorruptFileError
from gemport._src.tensors import finite

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# The safetensors format's other dtypes: well-formed files, which gemport does not decode.
_UNREAD = ("U16", "U32", "U64", "C64", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4")

_MAX_HEADER = 100 * 2**20
_COPY_CHUNK = 64 * 2**20
_ALIGN = 64
_READ_CHUNK = 32 * 2**20
_READERS = 2


def dtype_code(dtype) -> str:
    """The safetensors code (``"BF16"``, ``"F32"``, ...) of a numpy or JAX dtype."""
    try:
        return CODES[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be written to safetensors; cast to one of {', '.join(DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype code, shape and absolute byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One ``.safetensors`` file, its header validated on open.

    Raises ``CorruptFileError`` naming the file when it is truncated, its header is malformed, a dtype is
    unknown, or a tensor's byte range disagrees with its shape or lies outside the file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._parse()

    def _fail(self, what: str):
        raise CorruptFileError(f"{self.path}: {what}; the file is damaged or incomplete, download or write it again")

    def _parse(self) -> None:
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                self._fail(f"{size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                self._fail(f"header length {n} does not fit a file of {size} bytes")
            raw = fh.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._fail(f"header is not valid JSON ({e})")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        base = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            self._fail(f"__metadata__ is a {type(self.metadata).__name__}, not an object")
        spans = []
        for name, t in header.items():
            try:
                dtype, shape, (begin, end) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            except (KeyError, TypeError, ValueError):
                self._fail(f"tensor {name!r} has a malformed header entry {t!r}")
            if dtype in _UNREAD:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has dtype {dtype}, valid in safetensors but not one gemport "
                    f"reads ({', '.join(DTYPES)}); convert the checkpoint to bf16 or f32 first"
                )
            if dtype not in DTYPES:
                self._fail(f"tensor {name!r} has unknown dtype {dtype!r}")
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                self._fail(f"tensor {name!r} has invalid shape {list(shape)}")
            if any(isinstance(o, bool) or not isinstance(o, int) for o in (begin, end)):
                self._fail(f"tensor {name!r} has data_offsets {[begin, end]}, which are not integers")
            if begin < 0 or end < begin:
                self._fail(f"tensor {name!r} has data_offsets {[begin, end]}: negative or reversed")
            expected = math.prod(shape) * DTYPES[dtype].itemsize
            if end - begin != expected:
                self._fail(f"tensor {name!r} spans {end - begin} bytes but dtype {dtype} shape {list(shape)} needs {expected}")
            if base + end > size:
                self._fail(f"tensor {name!r} ends at byte {base + end}, past the end of the file ({size} bytes)")
            spans.append((begin, end, name))
            self.tensors[name] = TensorInfo(self.path, dtype, shape, base + begin, base + end)
        spans.sort()
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                self._fail(f"tensors {a!r} and {b!r} overlap")

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new numpy array (bf16 and fp8 via ml_dtypes)."""
        return read_array(self.tensors[name])


def read_array(info: TensorInfo) -> np.ndarray:
    """The tensor at ``info`` as a new numpy array, 64-byte aligned so JAX can adopt it without a copy.

    Large tensors are read in chunks by two threads: copying out of the page cache is CPU-bound, and one
    thread leaves the second core idle.
    """
    buffer = np.empty(info.nbytes + _ALIGN, np.uint8)
    skip = -buffer.ctypes.data % _ALIGN
    data = buffer[skip : skip + info.nbytes]
    view = memoryview(data)
    fd = os.open(info.file, os.O_RDONLY)

    def read(start: int) -> None:
        end = min(start + _READ_CHUNK, info.nbytes)
        while start < end:
            n = os.preadv(fd, [view[start:end]], info.start + start)
            if not n:
                raise CorruptFileError(f"{info.file}: ended while reading a tensor at byte {info.start + start}")
            start += n

    try:
        chunks = range(0, info.nbytes, _READ_CHUNK)
        if len(chunks) > 1:
            with ThreadPoolExecutor(_READERS) as pool:
                list(pool.map(read, chunks))
        elif info.nbytes:
            read(0)
    finally:
        os.close(fd)
    return data.view(DTYPES[info.dtype]).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """A tensor to write: its name, dtype code and shape, and a callable that writes its bytes to a file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    write: Callable[[BinaryIO], None]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @classmethod
    def from_array(cls, name: str, make: Callable[[], np.ndarray], dtype, shape) -> TensorSource:
        """A tensor computed when written: ``make()`` must return an array of ``dtype`` and ``shape``."""

        def write(fh: BinaryIO) -> None:
            array = np.ascontiguousarray(make())
            if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise RuntimeError(  # gemport's own inconsistency, not a property of any input
                    f"tensor {name!r} was declared {np.dtype(dtype)} {list(shape)} but produced "
                    f"{array.dtype} {list(array.shape)}"
                )
            if not finite(array):
                warnings.warn(f"tensor {name!r} holds NaN or Inf; a model with it computes NaN", RuntimeWarning,
                              stacklevel=2)
            fh.write(memoryview(array.reshape(-1).view(np.uint8)))

        return cls(name, dtype_code(dtype), tuple(shape), write)

    @classmethod
    def copy_of(cls, name: str, info: TensorInfo) -> TensorSource:
        """Tensor bytes copied from another file without decoding them (in the kernel where it can)."""

        def write(fh: BinaryIO) -> None:
            fh.flush()
            with open(info.file, "rb", buffering=0) as src:
                done = _copy_in_kernel(src.fileno(), fh.fileno(), info.start, info.nbytes)
                src.seek(info.start + done)
                left = info.nbytes - done
                buffer = memoryview(bytearray(min(left, _COPY_CHUNK)))
                while left:
                    n = src.readinto(buffer[: min(left, len(buffer))])
                    if not n:
                        raise CorruptFileError(f"{info.file}: ended while copying tensor {name!r}")
                    fh.write(buffer[:n])
                    left -= n

        return cls(name, info.dtype, info.shape, write)


def _copy_in_kernel(src: int, dst: int, offset: int, count: int) -> int:
    """Copies up to ``count`` bytes from ``src`` at ``offset`` to ``dst``'s position with copy_file_range,
    as ``cp`` does; returns how many were copied (fewer where the kernel or filesystem cannot)."""
    done = 0
    while done < count:
        try:
            n = os.copy_file_range(src, dst, count - done, offset + done)
        except OSError:
            break
        if not n:
            break
        done += n
    return done


def write_file(path: str | Path, sources: Iterable[TensorSource], metadata: dict[str, str] | None = None) -> int:
    """Write ``sources`` to a safetensors file at ``path``, one tensor in memory at a time.

    Returns the number of data bytes written. The caller makes the write atomic (see ``atomic_dir``).
    """
    sources = list(sources)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for s in sources:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for s in sources:
            before = fh.tell()
            s.write(fh)
            if fh.tell() - before != s.nbytes:
                raise RuntimeError(f"{path}: tensor {s.name!r} wrote {fh.tell() - before} bytes, expected {s.nbytes}")
        fh.flush()
        os.fsync(fh.fileno())
    return offset
