"""Compiled programs kept on disk: JAX's persistent compilation cache, for the runs of a host.

The train step of a 26-layer Gemma compiles for about 100 s on a TPU host, and a run resumed after a preemption, or
rerun with the same recipe, compiles the same program again. With a cache directory, XLA's executable for a program
(keyed by JAX on the program with its debug locations stripped, the devices, the compile options, the XLA flags and
the JAX/libtpu versions) is written once and loaded by every later process that compiles the same program: a
different recipe, mesh, remat, version or flag compiles afresh, so what loads is what would have been compiled.
``gemport sft`` and ``gemport dpo`` keep their programs in `default_dir` unless told otherwise (``--compile-cache``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from gemport._src import upstream
from gemport.step.fit import refused

ENV = "GEMPORT_COMPILE_CACHE"
"""The environment variable naming the cache directory of ``gemport sft``/``dpo`` ("off": none)."""

OFF = "off"

_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def default_dir() -> str | None:
    """The cache directory of a run not told one: ``$GEMPORT_COMPILE_CACHE`` (None where it is "off"), else the
    directory JAX was given (``JAX_COMPILATION_CACHE_DIR``), else ``$XDG_CACHE_HOME/gemport/xla``
    (``~/.cache/gemport/xla``)."""
    given = os.environ.get(ENV) or jax.config.jax_compilation_cache_dir
    if given:
        return None if given == OFF else given
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gemport" / "xla")


@dataclasses.dataclass
class CacheUse:
    """What this process loaded from the cache: ``loaded`` programs, ``recalled`` refusals (programs XLA refused
    to compile before, past the chips' memory: ``step.fit.refused``), ``saved_s`` seconds of compiling they took
    when first compiled (less the time to read the programs)."""

    path: str
    previous: str | None = None  # JAX's cache directory before, which `close` gives back
    loaded: int = 0
    recalled: int = 0
    saved_s: float = 0.0
    closed: bool = False
    refusals: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack, repr=False)

    def _event(self, event: str, **_) -> None:
        if event == _HIT and not self.closed:
            self.loaded += 1

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event == _SAVED and not self.closed:
            self.saved_s += seconds

    def _recalled(self, seconds: float) -> None:
        self.recalled += 1
        self.saved_s += seconds

    def close(self) -> None:
        """Stop keeping programs in ``path`` and counting: JAX's cache directory back to what it was before
        `compile_cache` (so a command run in a longer process, a notebook's or a test's, leaves it as it was)."""
        # Its listeners stay registered, ignoring what comes (a library may clear JAX's listeners: Tunix's do).
        self.closed = True
        self.refusals.close()
        compilation_cache.set_cache_dir(self.previous)
        compilation_cache.reset_cache()

    def __str__(self) -> str:
        if not self.loaded and not self.recalled:
            return f"compile cache {self.path}: nothing loaded; what compiled is kept for a rerun"
        found = [f"{n} {what}{'s' * (n > 1)} {how}" for n, what, how in
                 ((self.loaded, "program", "loaded"), (self.recalled, "refusal", "recalled")) if n]
        return f"compile cache {self.path}: {' and '.join(found)}, {max(self.saved_s, 0.0):.0f} s of compiling saved"


def compile_cache(path: str | os.PathLike) -> CacheUse:
    """Keep every program this process compiles from now on in the directory ``path`` (a local one is created if
    missing; a ``gs://`` one, shared by several hosts, is JAX's to reach), and load it from there when a later
    process compiles the same program (JAX's persistent compilation cache); a program XLA refused for the devices'
    memory (``step.fit.refused``) is kept as that refusal, which a later compile of it raises at once
    (``_src.upstream.refusals_kept``). Programs that compile in under
    ``jax_persistent_cache_min_compile_time_secs`` (1 s by default) are not kept; under ``jax.distributed`` only
    process 0 writes, so the other hosts load only from a directory they share with it. The directory is
    trusted: whoever can write to it runs code in the processes that load from it.

    Returns:
      The `CacheUse` that counts what this process loads from ``path`` from now on (``close()`` to stop).

    Example (it sets JAX's configuration for the whole process, so it is not run as a doctest)::

      use = compile_cache("~/.cache/gemport/xla")  # before the first compile
      run.train()
      print(use)  # "compile cache DIR: N programs loaded, S s of compiling saved"
    """
    path = os.fspath(path)
    if "://" not in path:
        path = os.fspath(Path(path).expanduser())
        Path(path).mkdir(parents=True, exist_ok=True)
    use = CacheUse(path, previous=jax.config.jax_compilation_cache_dir)
    compilation_cache.set_cache_dir(path)
    # JAX decides once per process, at its first compile, whether a cache is used: decide again with this one.
    compilation_cache.reset_cache()
    jax.monitoring.register_event_listener(use._event)
    jax.monitoring.register_event_duration_secs_listener(use._duration)
    use.refusals.enter_context(upstream.refusals_kept(refused, use._recalled))
    return use


__all__ = ["ENV", "OFF", "CacheUse", "compile_cache", "default_dir"]
