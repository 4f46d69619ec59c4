"""Which training checkpoints a run can resume from: each one verified readable, damaged ones set aside.

Orbax finalizes a checkpoint by renaming its temporary directory (or, on object stores, writing
``commit_success.txt``) once every file is written, so a save that is interrupted never looks finished. What
happens to the files afterwards (an interrupted copy, a disk that filled during a later rewrite, files zeroed by
a crashed host) Orbax does not see: it resumes from the newest step directory and fails deep inside JSON or
TensorStore. ``resume_step`` reads every array of the newest checkpoint back before the trainer resumes from
it; one that does not read back is renamed ``damaged-<step>`` (kept for inspection; Orbax does not count it,
so ``save_total_limit`` cannot delete an intact checkpoint in its favour) and the next older one is tried.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from gemport.errors import CheckpointWarning

ITEMS = ("model_params", "optimizer_state")
"""The items of a Tunix PeftTrainer checkpoint (``<root>/<step>/<item>``); ``model_params`` is required."""

METADATA = "_CHECKPOINT_METADATA"
DAMAGED = "damaged-"
"""The prefix a damaged step directory is renamed with (``<root>/damaged-<step>``)."""

def steps(root: str | os.PathLike) -> list[int]:
    """The steps of the checkpoint root ``root`` (its directories named by a step), ascending."""
    root = Path(root)
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir()) if root.is_dir() else []


def damage(step_dir: str | os.PathLike) -> str | None:
    """Why the Tunix checkpoint at ``step_dir`` cannot be resumed from, or None when every array reads back.

    Reads the checkpoint's metadata and every array of its items into host memory (a LoRA run's
    checkpoint holds the LoRA factors and their optimizer state: small beside the model).
    """
    step_dir = Path(step_dir)
    try:
        metadata = json.loads((step_dir / METADATA).read_text())
    except FileNotFoundError:
        return f"no {METADATA}"
    except (OSError, ValueError) as e:
        return f"{METADATA} is not readable JSON ({type(e).__name__})"
    items = [name for name in ITEMS if name in (metadata.get("item_handlers") or {}) or name == "model_params"]
    for name in items:
        where = step_dir / name
        if not where.is_dir():
            return f"no {name} directory"
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                stored = checkpointer.metadata(where)
                tree = getattr(getattr(stored, "item_metadata", stored), "tree", None)
                if not tree:
                    return f"{name}: its array metadata does not read back"
                restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
                checkpointer.restore(where, args=ocp.args.PyTreeRestore(restore_args=restore))
        except Exception as e:  # any failure to read back is damage; its text is Orbax's or TensorStore's
            return f"{name} does not read back ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    return None


def resume_step(root: str | os.PathLike) -> int | None:
    """The newest step of checkpoint root ``root`` whose checkpoint reads back whole, or None if none does.

    Every newer, damaged checkpoint is renamed ``<root>/damaged-<step>`` (by process 0 under
    ``jax.distributed``; every process verifies) with a ``CheckpointWarning`` naming it and why, so that Tunix's
    ``CheckpointManager`` resumes from the step returned and later saves take the damaged steps' place.
    """
    root = Path(root)
    found, skipped = None, []
    for step in reversed(steps(root)):
        why = damage(root / str(step))
        if why is None:
            found = step
            break
        aside = root / f"{DAMAGED}{step}"
        n = 1
        while aside.exists():
            n += 1
            aside = root / f"{DAMAGED}{step}.{n}"
        if jax.process_index() == 0:
            os.replace(root / str(step), aside)
        skipped.append(f"step {step} ({why}; set aside as {aside})")
    if skipped:
        then = f"resuming from step {found}" if found is not None else "no intact checkpoint left: training from step 0"
        warnings.warn(f"{root}: damaged checkpoint skipped: {'; '.join(skipped)}; {then}", CheckpointWarning,
                      stacklevel=2)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("gemport resume_step")
    return found


__all__ = ["DAMAGED", "ITEMS", "damage", "resume_step", "steps"]
