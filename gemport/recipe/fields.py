"""The one table of the TRL/HF fields gemport reads: each field's owner, its kind and what reads it.

A field belongs to one of TRL's dataclasses: ``ScriptArguments`` (the dataset), ``ModelConfig`` (the model and its
LoRA), ``SFTConfig`` / ``DPOConfig`` (each a ``transformers.TrainingArguments`` with TRL's own fields). Its default
is its owner's (``gemport.recipe.owners.defaults``: recorded from TRL and transformers), never written down here. A field a recipe sets is of
one kind:

- used: gemport reproduces what TRL does with it (``SFT``, ``DPO``, ``SCRIPT``, ``MODEL``); the consumer that reads
  it is named beside it, and each consumer reads its group as a typed value (``OptimizerFields``,
  ``OrderFields``, ``DataFields``, ``RunFields``, ``OutputsFields``, ``DPOLossFields``: ``from_config``);
- mapped: it has no TPU/JAX counterpart or is TRL's own bookkeeping; gemport accepts it and says what it does
  instead (``MAPPED``, ``DPO_MAPPED``);
- refused: any other field set to a value other than its default (``REFUSED_WHEN_SET``, ``DEFAULT_ONLY`` and
  ``STRATEGIES`` give the reasons of those gemport names), with a ``RecipeError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

from gemport.recipe.owners import defaults

SCRIPT = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming")
"""ScriptArguments fields gemport uses (``gemport.data.splits.load_splits``)."""

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


DEFAULT_ONLY = {
    "optim_args": "adamw_torch ignores optim_args in HF; remove them",
    "optim_target_modules": "it selects modules for GaLore/APOLLO optimizers, which gemport does not port",
    "deepspeed": "a DeepSpeed config can define its own optimizer and scheduler",
    "average_tokens_across_devices": "gemport normalises by the token count of the whole global batch, which is HF's "
                                     "behaviour with True; on a single GPU the flag has no effect, so drop it",
}
"""Fields that change the optimizer step in ways gemport does not reproduce: ``hf_optimizer`` refuses any value
other than the owner's default, giving the reason."""

RETIRED = {"warmup_ratio": "transformers 5.15 removed it: warmup_steps below 1 is the ratio since"}
"""Fields of older owners, still read from recipes and objects that have them; absent, they are None."""


_MISSING = object()


def _get(config: Any, name: str) -> Any:
    return config.get(name, _MISSING) if isinstance(config, Mapping) else getattr(config, name, _MISSING)


def _plain(value: Any) -> Any:
    # HF stores lr_scheduler_type, optim, the strategies as str enums: their values are what a recipe writes.
    return getattr(value, "value", value)


def _resolved(fields: dict[str, Any]) -> dict[str, Any]:
    # TRL resolves "auto" in __post_init__: 128 on Neuron, else None.
    if fields.get("pad_to_multiple_of") == "auto":
        fields["pad_to_multiple_of"] = None
    return fields


def given(config: Any, names: Sequence[str]) -> dict[str, Any]:
    """``{name: value}`` of those of ``names`` that ``config`` (a config object or a dict of its fields) holds; no
    default is read."""
    out = {name: _get(config, name) for name in names}
    return {name: _plain(v) for name, v in out.items() if v is not _MISSING}


@dataclasses.dataclass(frozen=True)
class Fields:
    """A consumer's group of trainer-config fields, typed: each subclass is one consumer's group and its
    ``from_config`` the one way that consumer reads a recipe. The values are as the recipe gives them (a
    consumer checks them and names the field it refuses); ``owner`` gives the absent ones' defaults."""

    owner: ClassVar[str] = "SFTConfig"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The group's field names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_config(cls, config: Any) -> Self:
        """The group's fields of ``config``: a config object (``TrainingArguments`` or a subclass such as
        ``SFTConfig``) or a dict of its fields.

        A field ``config`` lacks takes the default of ``owner`` (a key of ``OWNERS``), read from the installed class
        only then: a complete dict needs neither TRL nor transformers. A ``RETIRED`` field the owner lacks is None.
        HF's str enums (``lr_scheduler_type``, ``optim``...) become their values.

        Raises ``MissingDependencyError`` when a default is needed and its owner is not installed.
        """
        out = {name: _get(config, name) for name in cls.names()}
        if any(v is _MISSING for v in out.values()):
            default = {**dict.fromkeys(RETIRED), **_resolved(defaults(cls.owner))}
            out = {name: default[name] if v is _MISSING else v for name, v in out.items()}
        return cls(**{name: _plain(v) for name, v in out.items()})


@dataclasses.dataclass(frozen=True)
class OptimizerFields(Fields):
    """What ``gemport.optim.hf_optimizer`` reads (and ``DEFAULT_ONLY``, where given): AdamW, the schedule,
    clipping and the accumulation the optimizer steps over."""

    owner: ClassVar[str] = "TrainingArguments"
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    lr_scheduler_type: str
    lr_scheduler_kwargs: dict[str, Any] | None
    warmup_steps: float
    optim: str
    gradient_accumulation_steps: int
    warmup_ratio: float | None  # RETIRED: None where transformers has no such field


@dataclasses.dataclass(frozen=True)
class OrderFields(Fields):
    """What ``gemport.data.optimizer_steps`` reads: the sample order and the optimizer steps."""

    owner: ClassVar[str] = "TrainingArguments"
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    seed: int
    data_seed: int | None
    train_sampling_strategy: str
    max_steps: int
    num_train_epochs: float
    dataloader_drop_last: bool


@dataclasses.dataclass(frozen=True)
class DataFields(Fields):
    """What ``gemport.data.from_sft_config`` reads: the data, the batch geometry and ``remat_of``'s remat."""

    assistant_only_loss: bool
    completion_only_loss: bool | None
    max_length: int | None
    truncation_mode: str
    packing: bool
    packing_strategy: str
    padding_free: bool
    pad_to_multiple_of: int | None
    dataset_text_field: str
    eos_token: str | None
    pad_token: str | None
    loss_type: str
    shuffle_dataset: bool
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    gradient_checkpointing_kwargs: dict[str, Any] | None
    dataset_num_proc: int | None


@dataclasses.dataclass(frozen=True)
class RunFields(Fields):
    """What ``gemport.run.SFTRun`` (and ``gemport.run.DPORun``) reads beyond its pipeline's and its
    optimizer's: the template, evaluation, checkpoints, the dtype and products' precision, and the trackers."""

    output_dir: str | None
    seed: int
    bf16: bool | None
    tf32: bool | None
    gradient_accumulation_steps: int
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    eval_strategy: str
    eval_steps: float | None
    logging_steps: float
    save_strategy: str
    save_steps: float
    save_total_limit: int | None
    dataloader_drop_last: bool
    chat_template_path: str | None
    resume_from_checkpoint: str | bool | None
    report_to: str | list[str] | None


@dataclasses.dataclass(frozen=True)
class OutputsFields(Fields):
    """What ``gemport.run.outputs`` reads: ``trainer_state.json``, the trackers, the bar, ``step_epochs``."""

    logging_steps: float
    logging_first_step: bool
    logging_strategy: str
    eval_steps: float | None
    save_steps: float
    num_train_epochs: float
    per_device_train_batch_size: int
    dataloader_drop_last: bool
    report_to: str | list[str] | None
    disable_tqdm: bool | None
    eval_on_start: bool


@dataclasses.dataclass(frozen=True)
class PreferenceFields(Fields):
    """What ``gemport.run.DPORun`` reads of a ``DPOConfig`` to lay its preference pairs out: truncation, batch
    geometry and TRL's ``disable_dropout``."""

    owner: ClassVar[str] = "DPOConfig"
    max_length: int | None
    truncation_mode: str
    pad_to_multiple_of: int | None
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    gradient_accumulation_steps: int
    dataloader_drop_last: bool
    disable_dropout: bool


@dataclasses.dataclass(frozen=True)
class DPOLossFields(Fields):
    """What ``gemport.step.from_dpo_config`` reads (those it does not reproduce are refused there, by name)."""

    owner: ClassVar[str] = "DPOConfig"
    beta: float
    loss_type: str | list[str]
    loss_weights: list[float] | None
    label_smoothing: float
    discopop_tau: float
    ld_alpha: float | None
    f_divergence_type: str
    use_weighting: bool
    precompute_ref_log_probs: bool
    sync_ref_model: bool


SFT = (
    # data (gemport.data.from_sft_config)
    "assistant_only_loss", "completion_only_loss", "max_length", "truncation_mode", "packing", "packing_strategy",
    "padding_free", "pad_to_multiple_of", "dataset_text_field", "eos_token", "pad_token", "loss_type",
    "shuffle_dataset", "chat_template_path", "dataset_num_proc",
    # sample order and steps (gemport.data.optimizer_steps)
    "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed", "train_sampling_strategy",
    "max_steps", "num_train_epochs", "dataloader_drop_last",
    # optimizer and schedule (gemport.optim.hf_optimizer)
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "optim", "average_tokens_across_devices",
    # run: precision, evaluation, logging, checkpoints, outputs (gemport.run.sft, gemport.run.outputs)
    "output_dir", "bf16", "tf32", "eval_strategy", "eval_steps", "per_device_eval_batch_size", "eval_on_start",
    "logging_strategy", "logging_steps", "logging_first_step", "logging_dir", "report_to", "run_name", "project",
    "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint", "disable_tqdm",
    # memory (gemport.data.sft.remat_of: decoder remat, set on the model by gemport.run.sft)
    "gradient_checkpointing", "gradient_checkpointing_kwargs",
)
"""SFTConfig fields gemport uses."""

USED = frozenset(SCRIPT + MODEL + SFT)


DPO = (
    # data (gemport.data.preferences, gemport.data.collate)
    "max_length", "truncation_mode", "pad_to_multiple_of",
    # loss (gemport.step.from_dpo_config)
    *DPOLossFields.names(),
    # LoRA dropout off while training, as TRL sets every dropout module's p to 0 (gemport.run.dpo)
    "disable_dropout",
) + SFT[SFT.index("per_device_train_batch_size"):]
"""DPOConfig fields ``gemport dpo`` uses: its data and loss fields and SFT's run fields (order, optimizer,
evaluation, logging, checkpoints, remat)."""

DPO_MAPPED = {
    "dataset_num_proc": "the preference pairs are tokenized in this process (nothing is packed)",
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
    "use_cpu": "the run uses the JAX devices present (a TPU slice, or CPU)",
    "use_liger_kernel": "Tunix's loss and kernels are used; no Liger kernels",
    "liger_kernel_config": "see use_liger_kernel",
    "dataloader_num_workers": "batches are laid out once in this process and fed through Grain",
    "dataloader_pin_memory": "JAX transfers the batches; there is no pinned memory",
    "dataloader_persistent_workers": "see dataloader_num_workers",
    "dataloader_prefetch_factor": "see dataloader_num_workers",
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

REFUSED_WHEN_SET = {
    "push_to_hub": "gemport has no network access to the Hub here; upload output_dir yourself",
    "load_in_8bit": "8-bit bases are not ported (Qwix QLoRA here is NF4); train on the bfloat16 base",
    "fp16": "TPUs compute in bfloat16, not float16: set bf16 instead",
}
"""Fields refused when set (to a true value other than the default), with the reason."""

__all__ = ["COMMANDS", "DEFAULT_ONLY", "DPO", "DPO_MAPPED", "MAPPED", "MODEL", "QLORA", "REFUSED_WHEN_SET",
           "RETIRED", "SCRIPT", "SFT", "STRATEGIES", "TRL_LORA", "USED", "DataFields", "DPOLossFields", "Fields",
           "OptimizerFields", "OrderFields", "OutputsFields", "PreferenceFields", "RunFields", "given"]
