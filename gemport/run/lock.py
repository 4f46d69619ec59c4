"""One run at a time in an ``output_dir``, which must be writable: checked before anything long starts.

Two runs writing the same ``output_dir`` (a command started twice, a retry while the first still runs) would
interleave their checkpoints and ``trainer_state.json`` and each resume from the other's steps. ``claim_output``
takes an exclusive ``flock`` on ``<output_dir>/.gemport.lock``, held until the process ends (the kernel
releases it when a run is killed, so a stale lock never blocks the next run), and writes which process holds it
so the second run can name it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import tempfile
import warnings
from pathlib import Path

from gemport.errors import CheckpointError

LOCK = ".gemport.lock"
"""The lock file inside ``output_dir``."""

_HELD: dict[Path, object] = {}  # output_dir -> its open lock file, for the life of the process


def claim_output(output_dir: str | os.PathLike) -> Path:
    """Create ``output_dir`` if needed, check it is writable, and hold its lock for the life of this process.

    Claiming a directory this process already holds returns at once. On a filesystem without ``flock``
    (some network mounts) the run goes on with a warning that two runs there are not detected.

    Returns:
      ``output_dir`` resolved.

    Raises:
      CheckpointError: ``output_dir`` cannot be created or written (naming the OS's reason), or another
        process holds it (naming that process).
    """
    out = Path(output_dir).resolve()
    if out in _HELD:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".gemport-probe-"):
            pass
        handle = open(out / LOCK, "a+")
    except OSError as e:
        raise CheckpointError(
            f"output_dir {out}: cannot write there ({e.strerror or e}); give an output_dir this user can write, "
            "with room for the checkpoints and the adapter") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CheckpointError(
            f"output_dir {out} is in use by another run ({holder}); wait for it to end, stop it, or give "
            "another output_dir") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        warnings.warn(f"output_dir {out}: the filesystem cannot lock ({e.strerror}); a second run started in "
                      "this output_dir would not be detected", stacklevel=2)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC\n")
    handle.flush()
    _HELD[out] = handle
    return out


__all__ = ["LOCK", "claim_output"]
