"""What ``gemport sft`` and ``gemport dpo`` share: the environment and report of a ``--dry-run``, the resume point
checked, and the adapter written at the end of a run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gemport.errors import CheckpointError, RecipeError


def check_resume_point(value, root: Path) -> None:
    """Check ``resume_from_checkpoint`` against the checkpoints Tunix resumes from (the latest in ``root``).

    Raises:
      CheckpointError: no checkpoint in ``root``, or a path that is not its latest.
    """
    if value in (None, False, "", "false", "False"):
        return
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []
    if not steps:
        raise CheckpointError(f"resume_from_checkpoint={value!r}: no checkpoint in {root}")
    if value is True or str(value).lower() == "true":
        return
    wanted = Path(value).resolve()
    if wanted not in (root.resolve(), (root / str(steps[-1])).resolve()):
        raise CheckpointError(f"resume_from_checkpoint={value!r}: gemport resumes from the latest checkpoint of "
                              f"output_dir ({root / str(steps[-1])}); pass that, or true")


def _put_atomically(build, target: Path) -> None:
    """Write with ``build(tmp)`` beside ``target``, then move it into place (replacing an older one)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(tmp, target)


def write_adapter(trained, output_dir: Path, base_dir: Path, base: str, *, merge: bool, say=print) -> None:
    """Write a trained run's PEFT adapter into ``output_dir`` (and ``merged/`` with ``merge``), each atomically:
    ``trained`` is the run's ``lora_params()``, ``base`` the recipe's ``model_name_or_path`` the adapter names."""
    from gemport.checkpoint import export_merged, export_peft  # lazy: JAX; --help stays cheap
    from gemport.checkpoint.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # lazy: JAX; --help stays cheap

    staged = output_dir / ".adapter"
    _put_atomically(lambda tmp: export_peft(trained, tmp, base_dir=base_dir, base_model_name_or_path=str(base)),
                    staged)
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):  # the config last: a killed move leaves no new config on old weights
        os.replace(staged / name, output_dir / name)
    shutil.rmtree(staged)
    say(f"wrote {output_dir / ADAPTER_CONFIG}, {output_dir / ADAPTER_WEIGHTS}")
    if merge:
        _put_atomically(lambda tmp: export_merged(trained, tmp, base_dir=base_dir), output_dir / "merged")
        say(f"wrote {output_dir / 'merged'}")


def compile_for_dry_run(args) -> None:
    """Set the environment of a ``--dry-run [--tpu SLICE]`` compile (``sft`` and ``dpo``), before JAX starts."""
    # A compile for a TPU slice runs on this host's CPU (and must not take a TPU a run may hold); XLA:CPU orders a
    # program for memory, as accelerators do, only with this flag.
    from gemport.plan.compiled import CPU_MEMORY_SCHEDULER  # lazy: JAX; --help stays cheap

    if args.tpu and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if not args.tpu and CPU_MEMORY_SCHEDULER not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_MEMORY_SCHEDULER}".strip()


def add_compile_cache(parser) -> None:
    """``--compile-cache DIR|off`` on a training command's parser."""
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="keep the run's compiled programs in DIR and load them from there when a later run "
                             "(a resume, a rerun of the recipe) compiles the same: JAX's persistent compilation "
                             "cache; 'off': none (default: $GEMPORT_COMPILE_CACHE, else JAX_COMPILATION_CACHE_DIR, "
                             "else ~/.cache/gemport/xla). Not with --dry-run")


def use_compile_cache(args):
    """The ``run.compile_cache.CacheUse`` of a training command's ``--compile-cache`` (its default where not given;
    None when "off"), set before anything compiles. Raises RecipeError for ``--compile-cache`` with ``--dry-run``:
    a dry run compiles for another host or with CPU flags of its own, never the run's program."""
    from gemport.run.compile_cache import OFF, compile_cache, default_dir  # lazy: JAX; --help stays cheap

    if args.dry_run:
        if args.compile_cache is not None:
            raise RecipeError(f"--compile-cache {args.compile_cache}: a dry run compiles without the cache (its "
                              "program is not the run's); drop --compile-cache or --dry-run")
        return None
    path = default_dir() if args.compile_cache is None else args.compile_cache
    return None if path in (None, OFF) else compile_cache(path)


def report_dry_run(run, tpu: str | None, rows: str, say) -> int:
    """``gemport.plan.dry_run`` of ``run`` (an abstract ``SFTRun`` or ``DPORun``) said; 1 when it does not fit."""
    from gemport.mesh import TpuSlice  # lazy: JAX; --help stays cheap
    from gemport.plan import HBM, dry_run  # lazy: JAX; --help stays cheap

    say(f"dry run on {f'TPU {tpu}' if tpu else 'this host'}: {rows}, compiling the train step (nothing is trained "
        "or written)")
    report = dry_run(run, hbm_bytes=HBM[TpuSlice.parse(tpu).generation] if tpu else None)
    say(str(report))
    return 1 if report.fits is False else 0


__all__ = ["add_compile_cache", "check_resume_point", "compile_for_dry_run", "report_dry_run", "use_compile_cache",
           "write_adapter"]
