"""The recipe a run trains, recorded beside its checkpoints, so that a rerun resumes only the same recipe.

A rerun of ``gemport sft`` resumes from the latest checkpoint in its root (as preemption needs). That is only
the same training when the run is the same: the same fields that change what is trained, the same base, LoRA
and data. ``recipe_record`` is that identity, as JSON; ``check_resume`` compares it with the one recorded in the
checkpoint root and refuses a changed recipe, naming the changed entries, unless ``resume_from_checkpoint`` asks
to resume anyway (then the new recipe is recorded).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from gemport.errors import RecipeError
from gemport.data.flat import FlatExamples, digest
from gemport.data.tokenize import Example
from gemport.recipe import MAPPED

RECIPE_FILE = "gemport_recipe.json"
"""The record's name in the checkpoint root (``<output_dir>/checkpoints/gemport_recipe.json``)."""

# SFTConfig fields that change where and how the run reports, evaluates or saves, never the trained weights (an
# exact resume is exact whatever they are); every other field is part of the record.
_NOT_TRAINING = frozenset({
    "output_dir", "overwrite_output_dir", "logging_dir", "logging_strategy", "logging_steps", "logging_first_step",
    "report_to", "run_name", "project", "trackio_space_id", "disable_tqdm", "resume_from_checkpoint",
    "eval_strategy", "eval_steps", "eval_on_start", "per_device_eval_batch_size", "eval_accumulation_steps",
    "eval_delay", "save_strategy", "save_steps", "save_total_limit", "save_only_model", "save_safetensors",
    "push_to_hub",
})


def _plain(value: Any) -> Any:
    # JSON's reading of a field value (enums by value, tuples as lists), so a record compares with its reread self.
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def data_hash(examples: Sequence[Example] | FlatExamples) -> str:
    """sha256 of the examples' tokens and loss masks, in order (``data.flat.digest``): the data as trained (after
    rendering, masks and truncation), the same on every process; of prepared examples, the digest their
    preparation recorded (nothing is read)."""
    return examples.digest if isinstance(examples, FlatExamples) else digest(examples)


def recipe_record(args: Mapping[str, Any], *, base_dir: str | os.PathLike, dtype: Any, lora_spec: Any,
                  qlora: Any, examples: Sequence[Example]) -> dict[str, Any]:
    """The identity of a run as JSON-ready ``{entry: value}``: ``SFTConfig.<field>`` for every field given that
    changes the trained weights (not ``output_dir``, logging, evaluation or saving cadence, ``MAPPED`` fields),
    ``base`` (the resolved base folder), ``dtype``, ``lora`` (the resolved ``LoraSpec``), ``qlora`` and ``data``
    (``data_hash``). Overrides are in ``args`` already."""
    out = {f"SFTConfig.{k}": _plain(v) for k, v in sorted(args.items())
           if k not in _NOT_TRAINING and k not in MAPPED and not k.startswith(("hub_", "_"))}
    lora = json.loads(lora_spec.to_json()) if hasattr(lora_spec, "to_json") else _plain(lora_spec)
    out.update({"base": str(Path(base_dir).resolve()), "dtype": str(getattr(dtype, "name", dtype)), "lora": lora,
                "qlora": None if qlora is None else _plain(repr(qlora)), "data": data_hash(examples)})
    return out


def check_resume(root: str | os.PathLike, record: Mapping[str, Any], *, explicit: bool) -> None:
    """Before a run resumes from the checkpoints in ``root``: refuse a recipe other than the recorded one.

    With no checkpoint in ``root`` (a fresh run) or the same recipe, (re)writes ``<root>/RECIPE_FILE``. A changed
    recipe, or checkpoints without a record, raise ``RecipeError`` naming the changed entries, unless
    ``explicit`` (``resume_from_checkpoint`` set): then the new recipe is recorded and the run resumes. Under
    ``jax.distributed`` every process checks and process 0 writes.
    """
    root = Path(root)
    path = root / RECIPE_FILE
    record = _plain(dict(record))
    resumes = root.is_dir() and any(p.name.isdigit() for p in root.iterdir())
    if resumes and not explicit:
        if not path.is_file():
            raise RecipeError(f"{root}: checkpoints without {RECIPE_FILE}, so gemport cannot tell whether this "
                              "recipe is the one they trained; set resume_from_checkpoint: true to resume from "
                              "them anyway, or choose another output_dir")
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RecipeError(f"{path}: unreadable ({e}); set resume_from_checkpoint: true to resume anyway") from None
        changed = sorted(k for k in {*record, *recorded} if record.get(k) != recorded.get(k))
        if changed:
            detail = "; ".join(f"{k}: {recorded.get(k)!r:.60} -> {record.get(k)!r:.60}" for k in changed)
            raise RecipeError(f"{root}: its checkpoints trained another recipe ({detail}); a rerun resumes only "
                              "the same recipe. Set resume_from_checkpoint: true to continue them with this one, "
                              "or choose another output_dir")
    if jax.process_index() != 0:
        return
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{RECIPE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


__all__ = ["RECIPE_FILE", "check_resume", "data_hash", "recipe_record"]
