"""The trackers a recipe's ``report_to`` names, reported to as HF's Trainer reports to them.

``names(report_to)`` reads the field as ``TrainingArguments`` does (``"none"``/None: none; ``"all"``: every
installed one; a name or a list of names) and checks, before anything loads, that each is one gemport reports
to (``tensorboard``, ``wandb``, ``trackio``) and is installed. ``open_trackers`` starts them on process 0 with
the run config HF uploads (``run_config``): ``{"peft_config": ..., **model config, **SFTConfig fields,
"model/num_parameters": ...}`` with ``*_token`` fields masked as ``TrainingArguments.to_dict`` masks them.
Each then gets every ``log_history`` entry as HF's ``on_log`` does: ``rewrite_logs`` names (``loss`` ->
``train/loss``, ``eval_loss`` -> ``eval/loss``, ``epoch`` -> ``train/epoch``) and, for W&B and trackio,
``train/global_step``, their x-axis. The trackers' own settings are read where HF reads them:

- W&B: ``WANDB_PROJECT`` (default ``huggingface``), ``run_name`` as the run's name, ``WANDB_MODE``,
  ``WANDB_DIR`` and the rest by ``wandb`` itself. ``WANDB_LOG_MODEL`` (model artifacts) is refused;
  ``WANDB_WATCH`` is not applied, as HF skips it on XLA devices.
- trackio: ``project`` and ``run_name``, ``resume="allow"``; ``TRACKIO_DIR`` and the rest by ``trackio``.
- TensorBoard: ``TENSORBOARD_LOGGING_DIR``, else ``logging_dir``, else ``output_dir/runs``; the SFTConfig
  fields and the model config as text (``args``, ``model_config``), as HF's callback writes them.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemport.errors import MissingDependencyError, RecipeError
from gemport.recipe import defaults

MODULES = {"tensorboard": "tensorboardX", "wandb": "wandb", "trackio": "trackio"}
"""The trackers gemport reports to, in the order HF lists installed ones for ``"all"``, with the module each
needs."""

_INSTALL = {"tensorboard": "pip install tensorboardX", "wandb": "pip install 'gemport[wandb]'",
            "trackio": "pip install 'gemport[trackio]'"}


def installed(name: str) -> bool:
    """Whether the module tracker ``name`` needs can be imported (found without importing it)."""
    return importlib.util.find_spec(MODULES[name]) is not None


def names(report_to: Any) -> tuple[str, ...]:
    """The trackers of ``report_to`` as ``TrainingArguments`` reads it: None or ``"none"``: none; ``"all"``:
    the installed ones; a name or a list of names.

    Raises ``RecipeError`` for a name gemport does not report to (HF's mlflow, comet_ml, ...), and
    ``MissingDependencyError`` for a named tracker that is not installed, with the pip command.
    """
    if report_to is None or report_to in ("none", ["none"]):
        return ()
    if report_to in ("all", ["all"]):
        return tuple(n for n in MODULES if installed(n))
    given = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in given:
        if name not in MODULES:
            raise RecipeError(f"report_to={report_to!r}: gemport reports to {', '.join(MODULES)}, 'all' or "
                              f"'none', not {name!r}")
        if not installed(name):
            raise MissingDependencyError(f"report_to={report_to!r}: {MODULES[name]} is not installed; "
                                         f"{_INSTALL[name]}, or leave {name} out of report_to")
    if "wandb" in given:
        log_model = os.environ.get("WANDB_LOG_MODEL", "false").lower()
        if log_model in ("end", "checkpoint"):
            raise RecipeError(f"WANDB_LOG_MODEL={log_model}: gemport does not upload models or checkpoints to "
                              "W&B (the adapter is in output_dir); unset WANDB_LOG_MODEL")
    return tuple(dict.fromkeys(given))


def hf_names(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ``log_history`` entry as HF's ``on_log`` hands it to trackers: without ``step``, ``eval_*`` as
    ``eval/*``, every other name as ``train/*`` (``transformers.integrations.rewrite_logs``)."""
    out = {}
    for key, value in entry.items():
        if key == "step":
            continue
        if key.startswith("eval_"):
            out["eval/" + key.removeprefix("eval_")] = value
        elif key.startswith("test_"):
            out["test/" + key.removeprefix("test_")] = value
        else:
            out["train/" + key] = value
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def sft_config_dict(args: Mapping[str, Any]) -> dict[str, Any]:
    """``TrainingArguments.to_dict()`` of the run's SFTConfig fields: every field (TRL's defaults under
    ``args``), enums as values, ``report_to`` as a list, ``*_token`` fields masked (``<EOS_TOKEN>``...)."""
    fields = {k: _plain(args[k] if k in args else v) for k, v in defaults("SFTConfig").items()}
    fields["report_to"] = list(names(fields["report_to"]))
    for key in fields:
        if key.endswith("_token"):
            fields[key] = f"<{key.upper()}>"
    return fields


def run_config(args: Mapping[str, Any], base_dir: str | os.PathLike, lora_config: Mapping[str, Any] | None,
               ) -> dict[str, Any]:
    """The config HF's W&B and trackio callbacks upload: ``peft_config`` ({adapter name: its
    ``adapter_config.json`` fields}), then the base's ``config.to_dict()``, then the SFTConfig fields
    (``sft_config_dict``) over them."""
    import transformers  # optional: transformers

    model = transformers.AutoConfig.from_pretrained(base_dir).to_dict()
    config = {**model, **sft_config_dict(args)}
    if lora_config is not None:
        config = {"peft_config": {"default": dict(lora_config)}, **config}
    return json.loads(json.dumps(config, default=str))


class Tracker:
    """One tracker's run: ``log(metrics, step)`` with HF's names (``hf_names``), ``finish()`` at the end."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    """Scalars at the global step in ``TENSORBOARD_LOGGING_DIR`` (else ``logging_dir``, else
    ``output_dir/runs``); the SFTConfig fields and the model config as text. ``start_step``: a resumed run's
    step, past which older events are dropped."""

    def __init__(self, args: Mapping[str, Any], config: Mapping[str, Any], output_dir: Path, start_step: int):
        from tensorboardX import SummaryWriter  # optional: tensorboardX

        logdir = os.environ.get("TENSORBOARD_LOGGING_DIR") or args.get("logging_dir") or output_dir / "runs"
        self.writer = SummaryWriter(str(Path(logdir).expanduser()), purge_step=start_step + 1 if start_step else None)
        sft = sft_config_dict(args)
        self.writer.add_text("args", json.dumps(sft, indent=2, sort_keys=True))
        self.writer.add_text("model_config", json.dumps({k: v for k, v in config.items()
                                                          if k not in sft and k != "peft_config"}, indent=2))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, str):
                self.writer.add_text(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class Wandb(Tracker):
    """A W&B run (``wandb.init(project=$WANDB_PROJECT or "huggingface", name=run_name)``, unless one is
    already started) with the run config and ``train/global_step`` as every metric's step."""

    def __init__(self, args: Mapping[str, Any], config: Mapping[str, Any], num_parameters: int):
        import wandb  # optional: wandb

        self.wandb = wandb
        if os.environ.get("WANDB_WATCH", "false") in ("all", "parameters", "gradients"):
            warnings.warn(f"WANDB_WATCH={os.environ['WANDB_WATCH']}: not applied, as HF's Trainer skips it on "
                          "XLA devices (it hooks torch modules)", stacklevel=2)
        if wandb.run is None:
            name = {} if args.get("run_name") is None else {"name": args["run_name"]}
            wandb.init(project=os.environ.get("WANDB_PROJECT", "huggingface"), **name)
        wandb.config.update(dict(config), allow_val_change=True)
        wandb.define_metric("train/global_step")
        wandb.define_metric("*", step_metric="train/global_step", step_sync=True)
        wandb.config["model/num_parameters"] = num_parameters

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.wandb.log({**metrics, "train/global_step": step})

    def finish(self) -> None:
        # HF leaves the run open (wandb finishes it at exit); so does this.
        pass


class Trackio(Tracker):
    """A trackio run (``trackio.init(project=project, name=run_name, resume="allow", ...)``) with the run config;
    ``finish()`` ends it, as HF's callback does at the end of training."""

    def __init__(self, args: Mapping[str, Any], config: Mapping[str, Any], num_parameters: int):
        import trackio  # optional: trackio

        self.trackio = trackio
        trackio.init(project=args.get("project", "huggingface"), name=args.get("run_name"),
                     space_id=args.get("trackio_space_id"), resume="allow", private=args.get("hub_private_repo"),
                     bucket_id=args.get("trackio_bucket_id"))
        trackio.config.update(dict(config), allow_val_change=True)
        trackio.config["model/num_parameters"] = num_parameters

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.trackio.log({**metrics, "train/global_step": step})

    def finish(self) -> None:
        self.trackio.finish()


def open_trackers(args: Mapping[str, Any], *, base_dir: str | os.PathLike, lora_config: Mapping[str, Any] | None,
                  num_parameters: int, output_dir: str | os.PathLike, start_step: int = 0) -> list[Tracker]:
    """Start the trackers of ``args["report_to"]`` (call on process 0 only). ``lora_config``: the adapter's
    ``adapter_config.json`` fields; ``num_parameters``: the model's, LoRA factors included."""
    chosen = names(args.get("report_to", "none"))
    if not chosen:
        return []
    config = run_config(args, base_dir, lora_config)
    out: list[Tracker] = []
    for name in chosen:
        try:
            if name == "tensorboard":
                out.append(TensorBoard(args, config, Path(output_dir), start_step))
            elif name == "wandb":
                out.append(Wandb(args, config, num_parameters))
            else:
                out.append(Trackio(args, config, num_parameters))
        except Exception as e:  # the tracker's own error (no API key, no network): said with what to do
            hint = "; WANDB_MODE=offline logs without network (wandb sync uploads later)" if name == "wandb" else ""
            raise RecipeError(f"report_to: {name} could not start its run ({type(e).__name__}: {e}){hint}") from e
    return out


__all__ = ["MODULES", "TensorBoard", "Tracker", "Trackio", "Wandb", "hf_names", "installed", "names",
           "open_trackers", "run_config", "sft_config_dict"]
