"""A ``trl sft --config sft.yaml [--key value ...]`` recipe read as TRL reads it, every field accounted for.

TRL's ``trl sft`` parses three dataclasses from one YAML plus command-line overrides: ``ScriptArguments``
(the dataset), ``ModelConfig`` (the model and its LoRA) and ``SFTConfig`` (``TrainingArguments`` and TRL's
data fields). ``read`` does the same and sorts every field the recipe sets into one of three kinds:

- used: gemport reads it and reproduces what TRL does with it (``USED``);
- mapped: it has no TPU/JAX counterpart or is TRL's own bookkeeping; gemport accepts it and says what it
  does instead (``MAPPED``, one sentence each, in ``Recipe.notes``);
- refused: any other field set to a value other than TRL's default, with an ``RecipeError`` naming
  it (also a name that is no field of the three).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemport.errors import RecipeError

SCRIPT = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split")
"""ScriptArguments fields gemport uses (``gemport.train.data.load_splits``)."""

QLORA = ("load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant")
"""ModelConfig fields of a QLoRA recipe's 4-bit base (``gemport.lora.QLoraSpec.from_config``, with ``dtype``)."""

MODEL = ("model_name_or_path", "dtype", "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
         "lora_target_parameters", "use_rslora", "lora_task_type") + QLORA
"""ModelConfig fields gemport uses: the base checkpoint, its dtype (QLoRA's compute dtype), the LoRA and the
4-bit base."""

TRL_LORA = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
            "lora_target_modules": "target_modules", "lora_target_parameters": "target_parameters",
            "use_rslora": "use_rslora"}
"""TRL's ModelConfig names of the LoRA fields -> PEFT's ``LoraConfig`` names."""

SFT = (
    # data (gemport.train.from_sft_config)
    "assistant_only_loss", "completion_only_loss", "max_length", "truncation_mode", "packing", "packing_strategy",
    "padding_free", "pad_to_multiple_of", "dataset_text_field", "eos_token", "pad_token", "loss_type",
    "shuffle_dataset", "chat_template_path",
    # sample order and steps (gemport.train.optimizer_steps)
    "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed", "train_sampling_strategy",
    "max_steps", "num_train_epochs", "dataloader_drop_last",
    # optimizer and schedule (gemport.optim.hf_optimizer)
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "optim", "average_tokens_across_devices",
    # run: evaluation, logging, checkpoints, outputs (gemport.train.run, gemport.train.outputs)
    "output_dir", "bf16", "eval_strategy", "eval_steps", "per_device_eval_batch_size", "eval_on_start",
    "logging_strategy", "logging_steps", "logging_first_step", "logging_dir", "report_to", "run_name", "project",
    "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint", "disable_tqdm",
    # memory (gemport.train.sft.remat_of: decoder remat, set on the model by gemport.train.run)
    "gradient_checkpointing", "gradient_checkpointing_kwargs",
)
"""SFTConfig fields gemport uses."""

USED = frozenset(SCRIPT + MODEL + SFT)

DPO = (
    # data (gemport.dpo.preferences, gemport.dpo.collate)
    "max_length", "truncation_mode", "pad_to_multiple_of",
    # loss (gemport.dpo.from_dpo_config: the fields it does not reproduce are refused there, by name)
    "beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau", "ld_alpha", "f_divergence_type",
    "use_weighting", "precompute_ref_log_probs", "sync_ref_model",
    # LoRA dropout off while training, as TRL sets every dropout module's p to 0 (gemport.dpo.run)
    "disable_dropout",
) + tuple(f for f in SFT[SFT.index("per_device_train_batch_size"):] if f not in ("eval_steps", "eval_on_start"))
"""DPOConfig fields ``gemport dpo`` uses: its data and loss fields and SFT's run fields (order, optimizer, logging,
checkpoints, remat); evaluation is not ported (``eval_strategy`` other than ``"no"`` is refused)."""

DPO_MAPPED = {
    "padding_free": "TRL 1.16 turns padding_free off itself (it falls back to padded rows); so does gemport",
    "pad_token": "padding is outside every row's attention and loss; its id changes nothing",
    "precompute_ref_batch_size": "acts only with precompute_ref_log_probs, which is left at False",
    "ref_model_mixup_alpha": "acts only with sync_ref_model, which is left at False",
    "ref_model_sync_steps": "acts only with sync_ref_model, which is left at False",
    "f_alpha_divergence_coef": "acts only with f_divergence_type alpha_divergence, which is not ported",
}
"""DPOConfig fields accepted without a counterpart (beside ``MAPPED``), with why."""

COMMANDS = {"sft": "SFTConfig", "dpo": "DPOConfig"}
"""The trainer config class each command reads (``read``'s ``command``)."""

MAPPED = {
    "attn_implementation": "Tunix's attention (segment-aware, so packed rows stay apart) replaces torch's",
    "model_revision": "model_name_or_path is read as a local directory; no revision is fetched",
    "trust_remote_code": "gemport builds Tunix's Gemma itself; no remote code runs",
    "model_init_kwargs": "the model is Tunix's Gemma, built by gemport.load_model",
    "activation_offloading": "XLA places activations; nothing is offloaded",
    "use_cache": "training never uses the KV cache",
    "torch_compile": "XLA compiles the train step",
    "torch_compile_backend": "XLA compiles the train step",
    "torch_compile_mode": "XLA compiles the train step",
    "tf32": "float32 matmuls run at XLA's default precision",
    "use_cpu": "the run uses the JAX devices present (a TPU slice, or CPU)",
    "use_liger_kernel": "Tunix's loss and kernels are used; no Liger kernels",
    "liger_kernel_config": "see use_liger_kernel",
    "dataloader_num_workers": "batches are laid out once in this process and fed through Grain",
    "dataloader_pin_memory": "JAX transfers the batches; there is no pinned memory",
    "dataloader_persistent_workers": "see dataloader_num_workers",
    "dataloader_prefetch_factor": "see dataloader_num_workers",
    "dataset_num_proc": "the masks pipeline tokenizes in this process, vectorised",
    "remove_unused_columns": "only the fields of TRL's dataset formats are read",
    "ddp_backend": "one JAX program over the mesh; no DDP",
    "ddp_timeout": "one JAX program over the mesh; no DDP",
    "ddp_find_unused_parameters": "one JAX program over the mesh; no DDP",
    "ddp_bucket_cap_mb": "one JAX program over the mesh; no DDP",
    "ddp_broadcast_buffers": "one JAX program over the mesh; no DDP",
    "ignore_bias_buffers": "one JAX program over the mesh; no DDP",
    "local_rank": "JAX's process index replaces torch's rank",
    "log_level": "gemport prints its own progress",
    "log_level_replica": "gemport prints its own progress",
    "log_on_each_node": "the first process logs",
    "logging_nan_inf_filter": "every logged loss is kept as computed",
    "skip_memory_metrics": "no memory metrics are logged",
    "do_train": "`gemport sft` always trains",
    "do_eval": "evaluation follows eval_strategy",
    "prediction_loss_only": "evaluation computes losses only",
    "full_determinism": "XLA on one device set is deterministic; the sample order is HF's",
    "include_num_input_tokens_seen": "tokens/s is shown in the progress bar",
    "bnb_4bit_quant_storage": "Qwix stores the 4-bit codes as uint4; the storage dtype changes no value",
}
"""Fields accepted without a counterpart, with what gemport does instead."""

STRATEGIES = {"eval_strategy": ("no", "steps"), "save_strategy": ("no", "steps"), "logging_strategy": ("steps",)}
"""The ``*_strategy`` values gemport honours (HF's ``"epoch"`` and ``"best"`` are not reproduced)."""

_REFUSED_WHEN_SET = {
    "push_to_hub": "gemport has no network access to the Hub here; upload output_dir yourself",
    "dataset_streaming": "gemport lays out every step's batch ahead (HF's order needs the dataset's length)",
    "load_in_8bit": "8-bit bases are not ported (Qwix QLoRA here is NF4); train on the bfloat16 base",
    "fp16": "TPUs compute in bfloat16, not float16: set bf16 instead",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A ``trl sft`` recipe: each dataclass' fields as set by the YAML and the overrides (TRL's defaults not
    filled in, except ``sft``, which holds every SFTConfig field (DPOConfig's, for ``gemport dpo``): the recipe's
    over TRL 1.16's defaults).

    script, model: the ScriptArguments and ModelConfig fields set; sft: the SFTConfig fields; notes: one line
    per mapped field the recipe sets, saying what gemport does instead; source: the YAML path.
    """

    script: dict[str, Any]
    model: dict[str, Any]
    sft: dict[str, Any]
    notes: tuple[str, ...]
    source: Path | None

    def lora(self) -> dict[str, Any] | None:
        """The PEFT LoRA fields of ModelConfig's ``lora_*`` (with ModelConfig's defaults), or None without
        ``use_peft``."""
        if not self.model.get("use_peft"):
            return None
        defaults = {name: _default("ModelConfig", name) for name in TRL_LORA}
        fields = {**defaults, **{k: v for k, v in self.model.items() if k in TRL_LORA}}
        if fields.get("lora_target_parameters") is None:  # TRL's get_peft_config passes it only when set
            fields.pop("lora_target_parameters", None)
        return {"peft_type": "LORA", **{TRL_LORA[k]: v for k, v in fields.items()}}

    def qlora(self):
        """The ``gemport.lora.QLoraSpec`` of the recipe's 4-bit base (``load_in_4bit`` with ``bnb_4bit_quant_type``,
        ``use_bnb_nested_quant`` and ``dtype`` as the compute dtype, as TRL passes them to bitsandbytes), or None.
        Raises ``LoraError`` naming a field gemport cannot reproduce (``bnb_4bit_quant_type: fp4``...)."""
        from gemport.lora import QLoraSpec

        return QLoraSpec.from_config({k: v for k, v in self.model.items() if k in (*QLORA, "dtype")})

    def dtype(self):
        """The base weights' dtype: ModelConfig's ``dtype`` when set (not ``"auto"``), else bfloat16 with ``bf16``
        (TRL's default), else float32."""
        import jax.numpy as jnp

        name = self.model.get("dtype")
        if name not in (None, "auto"):
            try:
                return jnp.dtype(name)
            except TypeError:
                raise RecipeError(f"dtype={name!r}: not a dtype; give bfloat16, float32 or auto") from None
        return jnp.dtype(jnp.bfloat16 if self.sft["bf16"] else jnp.float32)


def _classes(command: str = "sft"):
    import trl
    from trl import ModelConfig, ScriptArguments

    return {"ScriptArguments": ScriptArguments, "ModelConfig": ModelConfig,
            COMMANDS[command]: getattr(trl, COMMANDS[command])}


def class_defaults(cls) -> dict[str, Any]:
    """The defaults of dataclass ``cls`` (TRL's ``SFTConfig``, ``DPOConfig``...): {field name: default}, each
    field with a default or a default factory (called)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _default(class_name: str, name: str) -> Any:
    return class_defaults(_classes()[class_name]).get(name)


def parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` / ``--flag`` (True) / ``--key v1 v2`` (a list), values read as YAML
    (``1e-4`` as a number too), as ``trl sft`` takes them after ``--config``."""
    import yaml

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
    import yaml

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

    classes = _classes(command)
    trainer = COMMANDS[command]
    used, mapped = (USED, MAPPED) if command == "sft" else (frozenset(SCRIPT + MODEL + DPO), {**MAPPED, **DPO_MAPPED})
    defaults = {name: class_defaults(cls) for name, cls in classes.items()}
    parts: dict[str, dict[str, Any]] = {name: {} for name in classes}
    notes = []
    for name, val in fields.items():
        owner = next((c for c in ("ScriptArguments", "ModelConfig", trainer) if name in defaults[c]), None)
        if owner is None:
            raise RecipeError(f"{where}{name}: not a field of trl {command}'s ScriptArguments, ModelConfig or "
                              f"{trainer}; check its spelling")
        parts[owner][name] = val
        default = defaults[owner][name]
        if name in _REFUSED_WHEN_SET and val and val != default:
            raise RecipeError(f"{where}{name}={val!r}: {_REFUSED_WHEN_SET[name]}")
        # hub_* only act with push_to_hub, which is refused above.
        if name in used or val == default or name.startswith("hub_"):
            continue
        if mapped.get(name):
            notes.append(f"{name}={val!r}: {mapped[name]}")
            continue
        raise RecipeError(f"{where}{name}={val!r}: gemport {command} does not reproduce this field; leave it at "
                          f"TRL's default {default!r} (docs/{command}.md lists every field)")
    model = parts["ModelConfig"]
    if model.get("lora_task_type", "CAUSAL_LM") != "CAUSAL_LM":
        raise RecipeError(f"{where}lora_task_type={model['lora_task_type']!r}: gemport trains causal LMs")
    sft = {**defaults[trainer], **parts[trainer]}
    if sft["pad_to_multiple_of"] == "auto":  # TRL: 128 on Neuron, else None
        sft["pad_to_multiple_of"] = None
    if sft["bf16"] is None:  # TRL: bf16 unless fp16
        sft["bf16"] = not sft["fp16"]
    check_strategies(sft, where)
    return Recipe(parts["ScriptArguments"], model, sft, tuple(notes), source)


def check_strategies(sft: Mapping[str, Any], where: str = "") -> None:
    """Raises ``RecipeError`` naming an ``eval_strategy`` / ``save_strategy`` / ``logging_strategy`` value gemport
    does not honour (``STRATEGIES``); HF's enums are read by value."""
    for name, allowed in STRATEGIES.items():
        value = getattr(sft.get(name), "value", sft.get(name))
        if name in sft and value not in allowed:
            raise RecipeError(f"{where}{name}={value!r}: gemport runs {' or '.join(map(repr, allowed))}; give "
                              f"'steps' with {name.split('_')[0]}_steps")


__all__ = ["COMMANDS", "DPO", "DPO_MAPPED", "MAPPED", "MODEL", "QLORA", "SCRIPT", "SFT", "STRATEGIES", "USED", "Recipe",
           "check_strategies", "class_defaults",
           "parse_overrides", "read"]
