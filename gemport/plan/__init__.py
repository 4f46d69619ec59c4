"""Planning a run before renting: what each device holds, estimated and compiled, and the whole recipe checked.

Planning sits above training: it compiles the step ``gemport.run`` trains, never one of its own.
``memory_plan`` / ``valid_meshes`` estimate what each device of an (fsdp, tp) mesh holds (params, LoRA, Adam
moments, a train step's gradients, activations and logits: ``gemport.plan.activations``) without compiling;
``compiled_peak`` compiles the train step ``SFTRun.train()`` runs (``gemport.plan.compiled.lower_step`` of
``HFPeftTrainer.jitted_train_step``) for abstract arguments, on this host's devices or a TPU slice's
(``gemport.mesh.slice_devices``); ``dry_run`` does so for a whole ``SFTRun`` built from ``config.json`` alone.
"""

from gemport.plan.compiled import compiled_peak
from gemport.plan.dry_run import DryRun, dry_run
from gemport.plan.memory import HBM, MemoryPlan, memory_plan, valid_meshes

__all__ = ["HBM", "DryRun", "MemoryPlan", "compiled_peak", "dry_run", "memory_plan", "valid_meshes"]
