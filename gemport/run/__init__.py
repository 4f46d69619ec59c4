"""The run: a TRL recipe on JAX devices, as one object, and its bookkeeping.

``SFTRun`` (a ``trl sft`` recipe) and ``DPORun`` (a ``trl dpo`` recipe) build the model with LoRA on the mesh, the
batches in HF's order, the optimizer and Tunix's trainer (``gemport.run.trainer.HFPeftTrainer``: HF's
accumulation, exact resume), and train with HF's outputs (``run.outputs``: ``trainer_state.json``, trackers),
checkpoints that a rerun resumes only for the same recipe (``run.record``), one run per ``output_dir``
(``run.lock``) and a checkpoint on a spot VM's SIGTERM (``run.preemption``).
"""

from gemport.run.dpo import DPORun
from gemport.run.sft import SFTRun

__all__ = [
    "DPORun",
    "SFTRun",
]
