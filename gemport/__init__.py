"""gemport: move a Gemma LoRA fine-tuning recipe from PyTorch/HF to JAX/Tunix on TPU.

A TRL SFT recipe, whole (``gemport sft --config sft.yaml`` on the command line)::

    run = gemport.SFTRun.create("sft.yaml", "gemma-4-31b-it", "data.jsonl")  # SFTConfig + lora_* fields
    run.train()                                                              # Tunix, on the mesh
    run.export_peft("adapter")

The common flow reads from here, one call per step::

    spec = gemport.GemmaSpec.from_hf("gemma-4-31b-it")                 # architecture
    mesh = gemport.make_mesh(spec, fsdp=1, tp=4)                        # a mesh that fits it
    model = gemport.load_model("gemma-4-31b-it", spec=spec, mesh=mesh)  # HF weights, streamed, sharded
    model = gemport.apply_lora(model, spec, gemport.LoraSpec.from_peft(peft_config))
    pipeline = gemport.from_sft_config(sft_config, tokenizer)           # TRL's data handling: masks, packing
    optimizer = gemport.hf_optimizer(sft_config, num_training_steps=n)  # HF's AdamW step in Optax
    trainer = gemport.HFPeftTrainer(model, optimizer.tx, config, lora_spec=...)   # or gemport.train_step
    gemport.export_merged("checkpoints", "merged", base_dir="gemma-4-31b-it")      # for vLLM

``import gemport`` is cheap: every name, and the stages (``specs``, ``lora``, ``recipe``, ``checkpoint``, ``mesh``,
``data``, ``optim``, ``step``, ``run``, ``plan``, ``check``, ``cli``: a stage imports only those before it), load JAX
and friends on first use. The stages hold the rest of the API.
"""

import importlib

from gemport import errors
from gemport.errors import (
    BatchError,
    CheckpointError,
    CheckpointWarning,
    CorruptFileError,
    DefaultsWarning,
    EngineError,
    GemportError,
    LoraError,
    MaskError,
    MeshError,
    MissingDependencyError,
    MissingTensorError,
    OptimizerConfigError,
    Preempted,
    RecipeError,
    ShapeMismatchError,
    SpecError,
    TemplateMismatchError,
    TemplateMismatchWarning,
    TrainingError,
    UnexpectedTensorError,
    UnsafePathError,
    VerifyError,
)

__version__ = "0.1.0"

# The stages of a port, in the order data flows through them.
_SUBMODULES = ("specs", "lora", "recipe", "checkpoint", "mesh", "data", "optim", "step", "run", "plan", "check", "cli")

# Top-level name -> the module that defines it, imported on first access.
_LAZY = {
    "GemmaSpec": "gemport.specs",
    "make_mesh": "gemport.mesh",
    "memory_plan": "gemport.plan",
    "valid_meshes": "gemport.plan",
    "load_hf": "gemport.checkpoint",
    "load_model": "gemport.checkpoint",
    "save_hf": "gemport.checkpoint",
    "load_orbax": "gemport.checkpoint",
    "save_orbax": "gemport.checkpoint",
    "import_peft": "gemport.checkpoint",
    "load_lora": "gemport.checkpoint",
    "save_lora": "gemport.checkpoint",
    "export_merged": "gemport.checkpoint",
    "export_peft": "gemport.checkpoint",
    "LoraSpec": "gemport.lora",
    "LoraParams": "gemport.lora",
    "LoraLayout": "gemport.lora",
    "QLoraSpec": "gemport.lora",
    "load_qlora_model": "gemport.checkpoint",
    "apply_lora": "gemport.lora",
    "audit": "gemport.mesh",
    "fix_lora": "gemport.mesh",
    "optimizer_shardings": "gemport.mesh",
    "from_sft_config": "gemport.data",
    "SFTRun": "gemport.run",
    "hf_optimizer": "gemport.optim",
    "optimizer_steps": "gemport.data",
    "train_step": "gemport.step",
    "DPORun": "gemport.run",
    "HFPeftTrainer": "gemport.run.trainer",
    "micro_batches": "gemport.run.trainer",
    "compare_logits": "gemport.check.verify",
    "trajectory": "gemport.check.parity",
}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"gemport.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gemport' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = sorted([*errors.__all__, *_LAZY])
