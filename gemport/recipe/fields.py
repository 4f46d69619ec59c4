"""The one table of the TRL/HF fields gemport reads: each field's owner, its kind and what reads it.

A field belongs to one of TRL's dataclasses: ``ScriptArguments`` (the dataset), ``ModelConfig`` (the model and its
LoRA), ``SFTConfig`` / ``DPOConfig`` (each a ``transformers.TrainingArguments`` with TRL's own fields). Its default
is its owner's, read from the installed class (``defaults``), never written down here. A field a recipe sets is of
one kind:

- used: gemport reproduces what TRL does with it (``SFT``, ``DPO``, ``SCRIPT``, ``MODEL``); the consumer that reads
  it is named beside it, and each consumer reads its group (``OPTIMIZER``, ``ORDER``, ``DATA``, ``RUN``,
  ``OUTPUTS``, ``DPO_LOSS``) through ``gemport.recipe.values``;
- mapped: it has no TPU/JAX counterpart or is TRL's own bookkeeping; gemport accepts it and says what it does
  instead (``MAPPED``, ``DPO_MAPPED``);
- refused: any other field set to a value other than its default (``REFUSED_WHEN_SET``, ``DEFAULT_ONLY`` and
  ``STRATEGIES`` give the reasons of those gemport names), with a ``RecipeError``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from typing import Any

from gemport.errors import MissingDependencyError

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

DATA = ("assistant_only_loss", "completion_only_loss", "max_length", "truncation_mode", "packing", "packing_strategy",
        "padding_free", "pad_to_multiple_of", "dataset_text_field", "eos_token", "pad_token", "loss_type",
        "shuffle_dataset", "per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
        "gradient_checkpointing_kwargs")
"""What ``gemport.train.from_sft_config`` reads (the data, the batch geometry and ``remat_of``'s remat)."""

ORDER = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed", "train_sampling_strategy",
         "max_steps", "num_train_epochs", "dataloader_drop_last")
"""What ``gemport.train.optimizer_steps`` reads: the sample order and the optimizer steps."""

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

OPTIMIZER = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
             "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "optim", "gradient_accumulation_steps",
             *RETIRED)
"""What ``gemport.optim.hf_optimizer`` reads (and ``DEFAULT_ONLY``, where given)."""

RUN = ("output_dir", "seed", "bf16", "gradient_accumulation_steps", "per_device_train_batch_size",
       "per_device_eval_batch_size", "eval_strategy", "eval_steps", "logging_steps", "save_strategy", "save_steps",
       "save_total_limit", "dataloader_drop_last", "chat_template_path", "resume_from_checkpoint", "report_to")
"""What ``gemport.train.SFTRun`` reads beyond its pipeline's and its optimizer's (``gemport.dpo.DPORun`` too)."""

OUTPUTS = ("logging_steps", "logging_first_step", "logging_strategy", "eval_steps", "save_steps", "num_train_epochs",
           "per_device_train_batch_size", "dataloader_drop_last", "report_to", "disable_tqdm", "eval_on_start")
"""What ``gemport.train.outputs`` reads (``trainer_state.json``, trackers, the bar, ``step_epochs``)."""

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

DPO_LOSS = ("beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau", "ld_alpha", "f_divergence_type",
            "use_weighting", "precompute_ref_log_probs", "sync_ref_model")
"""What ``gemport.dpo.from_dpo_config`` reads (those it does not reproduce are refused there, by name)."""

DPO = (
    # data (gemport.dpo.preferences, gemport.dpo.collate)
    "max_length", "truncation_mode", "pad_to_multiple_of",
    # loss (gemport.dpo.from_dpo_config)
    *DPO_LOSS,
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

REFUSED_WHEN_SET = {
    "push_to_hub": "gemport has no network access to the Hub here; upload output_dir yourself",
    "dataset_streaming": "gemport lays out every step's batch ahead (HF's order needs the dataset's length)",
    "load_in_8bit": "8-bit bases are not ported (Qwix QLoRA here is NF4); train on the bfloat16 base",
    "fp16": "TPUs compute in bfloat16, not float16: set bf16 instead",
}
"""Fields refused when set (to a true value other than the default), with the reason."""

OWNERS = {"ScriptArguments": "trl", "ModelConfig": "trl", "SFTConfig": "trl", "DPOConfig": "trl",
          "TrainingArguments": "transformers"}
"""Each owner dataclass and the package it is read from (``gemport[trl]``, ``gemport[hf]``)."""

_EXTRAS = {"trl": "trl", "transformers": "hf"}


def owner_class(owner: str) -> type:
    """The owner dataclass named ``owner`` (a key of ``OWNERS``), imported from TRL or transformers.

    Raises ``MissingDependencyError`` naming the extra to install when its package is absent.
    """
    package = OWNERS[owner]
    try:
        return getattr(importlib.import_module(package), owner)
    except ImportError:
        raise MissingDependencyError(f"the defaults of {owner}'s fields are read from {package}, which is not "
                                     f"installed: pip install 'gemport[{_EXTRAS[package]}]', or give every field"
                                     ) from None


def class_defaults(cls: type) -> dict[str, Any]:
    """The defaults of dataclass ``cls`` (TRL's ``SFTConfig``, ``DPOConfig``...): {field name: default}, each
    field with a default or a default factory (called)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


@functools.cache
def _defaults(owner: str) -> dict[str, Any]:
    return class_defaults(owner_class(owner))


def defaults(owner: str) -> dict[str, Any]:
    """{field: default} of the owner dataclass ``owner`` (a key of ``OWNERS``) as installed: a new copy each call."""
    return copy.deepcopy(_defaults(owner))


__all__ = ["COMMANDS", "DATA", "DEFAULT_ONLY", "DPO", "DPO_LOSS", "DPO_MAPPED", "MAPPED", "MODEL", "OPTIMIZER",
           "ORDER", "OUTPUTS", "OWNERS", "QLORA", "REFUSED_WHEN_SET", "RETIRED", "RUN", "SCRIPT", "SFT", "STRATEGIES",
           "TRL_LORA", "USED", "class_defaults", "defaults", "owner_class"]
