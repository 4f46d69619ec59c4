"""Writing checkpoint directories: atomically, in HF's sharded layout.

Everything is written into a temporary sibling of the output directory, which is renamed into place only
when complete, so an interrupted run never leaves a directory that looks like a checkpoint. A run killed
outright leaves its temporary sibling behind; the next run to the same output removes it (`atomic_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from gemport.checkpoint.hf_dir import INDEX, SINGLE, hub_repo
from gemport.checkpoint.safetensors import TensorSource, write_file
from gemport.errors import CheckpointError, UnsafePathError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` or ``"500MiB"`` (HF's convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    if not m or m.group(2).upper() not in _UNITS:
        raise CheckpointError(f"max_shard_size {size!r}: expected a number of bytes or e.g. '5GB', '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_output(out_dir: str | Path, *inputs: str | Path | None) -> Path:
    """Refuse an output equal to or inside an input (``check_outside``), or an existing non-empty directory or
    file."""
    out = check_outside(out_dir, *inputs)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output {out} already exists and is not empty; remove it or choose another")
    return out


def check_outside(out_dir: str | Path, *inputs: str | Path | None) -> Path:
    """Refuse (``UnsafePathError``) an output equal to or inside an input; returns the output, resolved.

    An input that is a snapshot of the Hugging Face hub cache protects its whole repository folder
    (``models--org--name``), whose ``blobs/`` hold the snapshot's data.
    """
    out = Path(out_dir).resolve()
    for src in inputs:
        if src is None:
            continue
        src = Path(src).resolve()
        for protected in (src, hub_repo(src) if src.is_dir() else None):
            if protected is not None and (out == protected or out.is_relative_to(protected)):
                raise UnsafePathError(
                    f"output {out} is {'the same as' if out == protected else 'inside'} input {protected}; "
                    "choose a directory outside the input"
                )
    return out


# A partial output is the folder ".<name>.partial-<host>-<pid>-<random>" beside the output.
_HOST = socket.gethostname()
_PARTIAL = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]{8}(\..*)?")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale_partials(out_dir: Path) -> list[Path]:
    """Remove the partial outputs of ``out_dir`` left by dead processes of this host; return them.

    A run killed before it renamed its partial output into place (SIGKILL, out of memory, power loss) leaves
    it behind. It is stale when the process that wrote it is gone: same host name, no process with its PID.
    Partial outputs of running processes, and of other hosts (a shared file system), are left alone.
    """
    prefix = f".{out_dir.name}.partial-"
    removed = []
    for path in out_dir.parent.glob(glob.escape(prefix) + "*"):
        m = _PARTIAL.fullmatch(path.name[len(prefix):])
        if m and m["host"] == _HOST and not _alive(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a new temporary sibling directory; rename it to ``out_dir`` on success, remove it on failure.

    Stale partial outputs of ``out_dir`` are removed first (see `remove_stale_partials`). An ``OSError`` (no
    space left, read-only file system, a path through a file) becomes a ``CheckpointError`` naming
    ``out_dir``, as does finding ``out_dir`` written by another run when this one is done.
    """
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{_HOST}-{os.getpid()}-", dir=out_dir.parent))
    except OSError as e:
        raise CheckpointError(f"output {out_dir}: cannot write there ({e}); choose a writable location") from None
    try:
        yield tmp
        try:
            os.rename(tmp, out_dir)  # replaces an empty directory; fails on anything else
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise CheckpointError(
                    f"output {out_dir} appeared while this run was writing it (another run writing the same "
                    "output?); it was left as it is and this run's output discarded"
                ) from None
            raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"output {out_dir}: not written ({e}); the partial output was removed") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_sharded(directory: Path, sources: list[TensorSource], max_shard_size: int | str, desc: str) -> None:
    """Write ``sources`` in order as HF safetensors shards of at most ``max_shard_size`` bytes each.

    One shard is written as ``model.safetensors``; several as ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``. A tensor larger than the limit gets a shard of its own.
    """
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSource]] = [[]]
    size = 0
    for s in sources:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    total = sum(s.nbytes for s in sources)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False) as bar:
        for name, shard in zip(names, shards):
            write_file(directory / name, _counted(shard, bar))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {s.name: name for name, shard in zip(names, shards) for s in shard},
        }
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _counted(sources: list[TensorSource], bar) -> list[TensorSource]:
    def counting(s: TensorSource) -> TensorSource:
        def write(fh):
            s.write(fh)
            bar.update(s.nbytes)

        return TensorSource(s.name, s.dtype, s.shape, write)

    return [counting(s) for s in sources]


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy everything but weights (config, tokenizer, chat template, generation config...) from ``src``."""
    for p in src.iterdir():
        if p.is_file() and not (p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name == INDEX
                                or p.name.endswith(".index.json")):
            shutil.copy2(p, dst / p.name)
