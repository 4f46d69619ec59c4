"""What several ``gemport`` commands share: library defaults shown in ``--help``, the options the user gave, the
model and LoRA arguments, and the output checked against the inputs."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

MODEL_HELP = "an HF checkpoint directory or a preset name (e.g. gemma4-31b)"
"""The help of a command's model argument."""


class Default:
    """An option's default, read from the library function's signature when it is shown (``--help``), so the
    CLI never repeats a library default and parsing stays cheap (no JAX import)."""

    def __init__(self, function: str, parameter: str):
        self.function, self.parameter = function, parameter

    def __str__(self):
        module, name = self.function.rsplit(".", 1)
        return str(inspect.signature(getattr(importlib.import_module(module), name)).parameters[self.parameter].default)


def given(args, **names: str) -> dict:
    """``{parameter: args.<option>}`` for the options the user gave; the library's defaults apply to the rest.

    Args:
      args: the parsed command line.
      names: ``parameter="option"``: the library parameter each option sets.

    Returns:
      The parameters of the options not left at their ``Default``.
    """
    return {param: getattr(args, opt) for param, opt in names.items() if not isinstance(getattr(args, opt), Default)}


def add_lora_source(c, what: str) -> None:
    """Add the options that name where LoRA factors come from (``export``'s and ``verify``'s) to the parser ``c``;
    ``what`` names the checkpoint whose step ``--step`` picks."""
    c.add_argument("--step", type=int, help=f"{what} step (default: latest)")
    c.add_argument("--lora-config", help="a PEFT adapter_config.json or its directory, if gemport did not record "
                                         "the LoRA spec beside the checkpoint")


def spec_of(model: str):
    """The ``GemmaSpec`` of a model argument: an HF checkpoint directory, else a preset name."""
    from gemport.specs import GemmaSpec  # lazy: JAX; --help stays cheap

    return GemmaSpec.from_hf(model) if Path(model).exists() else GemmaSpec.preset(model)


def lora_spec_of(path: str | None):
    """The ``LoraSpec`` of a ``--lora-config`` (a PEFT adapter_config.json or its directory), None without one."""
    from gemport.lora import LoraSpec  # lazy: JAX; --help stays cheap

    return LoraSpec.from_peft(path) if path else None


def check_out(args) -> Path:
    """The output ``args.out``, refused if it is or lies inside any input of the command (``check_output``)."""
    from gemport.checkpoint import check_output  # lazy: JAX; --help stays cheap

    inputs = [getattr(args, name, None) for name in ("src", "base", "lora", "adapter", "model", "spec", "base_dir",
                                                     "lora_config")]
    return check_output(args.out, *(p for p in inputs if p and Path(p).exists()))


__all__ = ["MODEL_HELP", "Default", "add_lora_source", "check_out", "given", "lora_spec_of", "spec_of"]
