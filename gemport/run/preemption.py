"""Stop a training run at a step boundary on SIGTERM, with a checkpoint every process agrees on.

Spot and preemptible TPU VMs get a SIGTERM shortly before they are taken away. ``Preemption`` notices it
and, at the end of the step where every process can stop, saves a checkpoint and raises ``Preempted``: the
run ends with a clear message and a non-zero status, and the same command run again resumes from that
checkpoint (the sample order is a function of the optimizer step, so each sample is still trained once).

On one process the SIGTERM is caught with a Python signal handler. Under ``jax.distributed`` it is caught by
JAX's preemption service (on by default, ``jax_enable_preemption_service``), which tells every process and
agrees on the first step all of them can still reach: processes that got the signal at different steps, or
only some of them, stop after the same step and write one checkpoint together.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import multihost_utils

from gemport.errors import Preempted


class Preemption:
    """Watches for SIGTERM from construction until ``close`` (or the end of a ``with`` block).

    Call ``check(step, save)`` on every process after every optimizer step, starting from the same step on
    all of them: it returns at once unless the run must stop at ``step``; then it calls ``save()`` (which
    must write the checkpoint of ``step`` and wait until it is complete, e.g. Tunix's
    ``CheckpointManager.save(step, ..., force=True)`` followed by ``wait_until_finished``) and raises
    ``Preempted``. ``where`` names the checkpoint in the message. Build it after ``jax.distributed.initialize``
    (it asks JAX for the process count).
    """

    def __init__(self) -> None:
        self._received = False
        self._previous: Any = None
        # Several processes: JAX's preemption service owns SIGTERM and agrees on the step; a Python handler
        # would replace its C++ one.
        self._distributed = jax.process_count() > 1
        if not self._distributed:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._received = True

    def reached(self, step: int) -> bool:
        """Whether the run must stop after ``step`` (every process gets the same answer for the same step)."""
        if self._distributed:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._received

    def check(self, step: int, save: Callable[[], Any], *, where: str = "the checkpoint directory") -> None:
        """Save and raise ``Preempted`` if the run must stop after ``step``; else return."""
        if not self.reached(step):
            return
        start = time.monotonic()
        save()
        raise Preempted(step, where, time.monotonic() - start)

    def close(self) -> None:
        """Restore the SIGTERM handler found at construction."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Preempted", "Preemption"]
