"""The one reader of a recipe: a ``trl sft --config sft.yaml [--key value ...]`` read as TRL reads it, every field
accounted for.

TRL's ``trl sft`` parses three dataclasses from one YAML plus command-line overrides: ``ScriptArguments``
(the dataset), ``ModelConfig`` (the model and its LoRA) and ``SFTConfig`` (``TrainingArguments`` and TRL's
data fields). ``read`` does the same and sorts every field the recipe sets into one of the kinds of
``gemport.recipe.fields`` (used, mapped with a note in ``Recipe.notes``, refused with a ``RecipeError`` naming
it; also a name that is no field of the three). ``trainer_fields`` gives every SFTConfig / DPOConfig field of a
YAML, a dict or a config object through ``read``; each consumer takes its typed group of fields of any of those
(``gemport.recipe.fields``' ``OptimizerFields.from_config``...), absent ones at their owner's default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gemport.errors import RecipeError
from gemport.recipe.fields import (COMMANDS, DPO, DPO_MAPPED, MAPPED, MODEL, QLORA, REFUSED_WHEN_SET, SCRIPT,
                                   STRATEGIES, TRL_LORA, USED, _resolved, defaults)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A ``trl sft`` recipe: each dataclass' fields as set by the YAML and the overrides (TRL's defaults not
    filled in, except ``sft``, which holds every SFTConfig field (DPOConfig's, for ``gemport dpo``): the recipe's
    over the installed TRL's defaults).

    script, model: the ScriptArguments and ModelConfig fields set; sft: the SFTConfig fields; notes: one line
    per mapped field the recipe sets, saying what gemport does instead; source: the YAML path; given: the names of
    the ``sft`` fields the recipe sets.
    """

    script: dict[str, Any]
    model: dict[str, Any]
    sft: dict[str, Any]
    notes: tuple[str, ...]
    source: Path | None
    given: tuple[str, ...] = ()

    def lora(self) -> dict[str, Any] | None:
        """The PEFT LoRA fields of ModelConfig's ``lora_*`` (with ModelConfig's defaults), or None without
        ``use_peft``."""
        if not self.model.get("use_peft"):
            return None
        model = defaults("ModelConfig")
        fields = {**{name: model[name] for name in TRL_LORA}, **{k: v for k, v in self.model.items() if k in TRL_LORA}}
        if fields.get("lora_target_parameters") is None:  # TRL's get_peft_config passes it only when set
            fields.pop("lora_target_parameters", None)
        return {"peft_type": "LORA", **{TRL_LORA[k]: v for k, v in fields.items()}}

    def qlora(self):
        """The ``gemport.lora.QLoraSpec`` of the recipe's 4-bit base (``load_in_4bit`` with ``bnb_4bit_quant_type``,
        ``use_bnb_nested_quant`` and ``dtype`` as the compute dtype, as TRL passes them to bitsandbytes), or None.
        Raises ``LoraError`` naming a field gemport cannot reproduce (``bnb_4bit_quant_type: fp4``...)."""
        from gemport.lora import QLoraSpec  # JAX on first use: reading a recipe loads none

        return QLoraSpec.from_config({k: v for k, v in self.model.items() if k in (*QLORA, "dtype")})

    def dtype(self):
        """The base weights' dtype: ModelConfig's ``dtype`` when set (not ``"auto"``), else bfloat16 with ``bf16``
        (TRL's default), else float32."""
        import jax.numpy as jnp  # JAX on first use: reading a recipe loads none

        name = self.model.get("dtype")
        if name not in (None, "auto"):
            try:
                return jnp.dtype(name)
            except TypeError:
                raise RecipeError(f"dtype={name!r}: not a dtype; give bfloat16, float32 or auto") from None
        return jnp.dtype(jnp.bfloat16 if self.sft["bf16"] else jnp.float32)


def parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` / ``--flag`` (True) / ``--key v1 v2`` (a list), values read as YAML
    (``1e-4`` as a number too), as ``trl sft`` takes them after ``--config``."""

    def value(text: str) -> Any:
        parsed = yaml.safe_load(text)
        if isinstance(parsed, str):
            try:
                return float(parsed)
            except ValueError:
                return parsed
        return parsed

    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise RecipeError(f"override {token!r}: give recipe fields as --name value")
        name, eq, text = token[2:].partition("=")
        name = name.replace("-", "_")
        i += 1
        if eq:
            out[name] = value(text)
            continue
        values = []
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(value(argv[i]))
            i += 1
        out[name] = True if not values else values[0] if len(values) == 1 else values
    return out


def read(config: str | os.PathLike | Mapping[str, Any] | None, overrides: Mapping[str, Any] = (), *,
         command: str = "sft") -> Recipe:
    """The recipe of a ``trl sft --config`` YAML (or a dict of its fields) with ``overrides`` on top; with
    ``command="dpo"``, of a ``trl dpo --config`` YAML (DPOConfig's fields, ``DPO`` used, ``DPO_MAPPED`` mapped).

    ``env`` (a mapping) is set in ``os.environ``, as ``trl sft`` does. Raises ``RecipeError`` naming
    a field that is no field of ScriptArguments, ModelConfig or SFTConfig, or one gemport does not reproduce
    set to a value other than TRL's default, with the reason.
    """

    source = None
    fields: dict[str, Any] = {}
    if isinstance(config, (str, os.PathLike)):
        source = Path(config)
        try:
            fields = yaml.safe_load(source.read_text())
        except yaml.YAMLError as e:
            raise RecipeError(f"{source}: not YAML ({e})") from None
        if not isinstance(fields, Mapping):
            raise RecipeError(f"{source}: expected a YAML mapping of trl sft fields")
    elif config is not None:
        fields = dict(config)
    fields = {**fields, **dict(overrides)}
    where = f"{source}: " if source else ""
    env = fields.pop("env", None) or {}
    if not isinstance(env, Mapping):
        raise RecipeError(f"{where}env must be a mapping of environment variables")
    for key, val in env.items():
        os.environ[str(key)] = str(val)

    trainer = COMMANDS[command]
    classes = ("ScriptArguments", "ModelConfig", trainer)
    used, mapped = (USED, MAPPED) if command == "sft" else (frozenset(SCRIPT + MODEL + DPO), {**MAPPED, **DPO_MAPPED})
    default = {name: defaults(name) for name in classes}
    parts: dict[str, dict[str, Any]] = {name: {} for name in classes}
    notes = []
    for name, val in fields.items():
        owner = next((c for c in classes if name in default[c]), None)
        if owner is None:
            raise RecipeError(f"{where}{name}: not a field of trl {command}'s ScriptArguments, ModelConfig or "
                              f"{trainer}; check its spelling")
        parts[owner][name] = val
        if name in REFUSED_WHEN_SET and val and val != default[owner][name]:
            raise RecipeError(f"{where}{name}={val!r}: {REFUSED_WHEN_SET[name]}")
        # hub_* only act with push_to_hub, which is refused above.
        if name in used or val == default[owner][name] or name.startswith("hub_"):
            continue
        if mapped.get(name):
            notes.append(f"{name}={val!r}: {mapped[name]}")
            continue
        raise RecipeError(f"{where}{name}={val!r}: gemport {command} does not reproduce this field; leave it at "
                          f"TRL's default {default[owner][name]!r} (docs/{command}.md lists every field)")
    model = parts["ModelConfig"]
    if model.get("lora_task_type", "CAUSAL_LM") != "CAUSAL_LM":
        raise RecipeError(f"{where}lora_task_type={model['lora_task_type']!r}: gemport trains causal LMs")
    sft = _resolved({**default[trainer], **parts[trainer]})
    if sft["bf16"] is None:  # TRL: bf16 unless fp16
        sft["bf16"] = not sft["fp16"]
    check_strategies(sft, where)
    return Recipe(parts["ScriptArguments"], model, sft, tuple(notes), source, tuple(parts[trainer]))


def check_strategies(sft: Mapping[str, Any], where: str = "") -> None:
    """Raises ``RecipeError`` naming an ``eval_strategy`` / ``save_strategy`` / ``logging_strategy`` value gemport
    does not honour (``STRATEGIES``); HF's enums are read by value."""
    for name, allowed in STRATEGIES.items():
        value = getattr(sft.get(name), "value", sft.get(name))
        if name in sft and value not in allowed:
            raise RecipeError(f"{where}{name}={value!r}: gemport runs {' or '.join(map(repr, allowed))}; give "
                              f"'steps' with {name.split('_')[0]}_steps")


def trainer_fields(config: Any, command: str = "sft") -> dict[str, Any]:
    """Every ``SFTConfig`` field (``command="dpo"``: ``DPOConfig``) of ``config`` as a new dict.

    config: a ``trl sft --config`` YAML path or a dict of its fields (both through ``read``: an unknown or refused
    field raises ``RecipeError``; ModelConfig and ScriptArguments fields are left out), or a config object
    (``SFTConfig``, ``DPOConfig``, ``TrainingArguments``: its fields as set, the others at the trainer config's
    defaults).
    """
    if isinstance(config, (str, os.PathLike, Mapping)):
        return read(config, command=command).sft
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        given = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        fields = _resolved({**defaults(COMMANDS[command]), **given})
        if fields["bf16"] is None:  # TRL: bf16 unless fp16
            fields["bf16"] = not fields["fp16"]
        return fields
    raise RecipeError(f"{config!r:.80} is not a {COMMANDS[command]}, a dict of its fields or a YAML path")


__all__ = ["Recipe", "check_strategies", "parse_overrides", "read", "trainer_fields"]
