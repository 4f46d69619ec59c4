"""Training pieces with HF Trainer semantics, for your own nnx loop or Tunix's PeftTrainer.

``train_step`` takes one optimizer step as HF's Trainer does (token-weighted gradient accumulation,
HF's logged ``loss`` and pre-clip ``grad_norm``) with the optimizer of ``optim.hf_optimizer``;
``optimizer_steps`` gives the rows of each step in the order HF's Trainer feeds them (torch's seeded
``RandomSampler``, reproduced without torch), ``stack`` turns their micro-batches into a step's batch,
``from_sft_config`` maps an ``SFTConfig`` onto the masks pipeline, and ``SFTRun`` assembles a whole TRL SFT run
(model with LoRA on the mesh, batches, optimizer, Tunix trainer) from one ``SFTConfig``. ``gemport.train.peft_trainer``
(imported on its own: it needs Tunix) runs Tunix's ``PeftTrainer`` with HF's accumulation.
"""

from gemport.train.order import OptimizerStep, SamplingStrategy, optimizer_steps, randperm, sample_order
from gemport.train.run import SFTRun
from gemport.train.sft import LAYOUTS, Layout, SFTPipeline, from_sft_config
from gemport.train.step import BATCH_FIELDS, StepMetrics, segment_loss, stack, train_step, tunix_loss

__all__ = [
    "BATCH_FIELDS",
    "LAYOUTS",
    "Layout",
    "OptimizerStep",
    "SFTPipeline",
    "SFTRun",
    "SamplingStrategy",
    "StepMetrics",
    "from_sft_config",
    "optimizer_steps",
    "randperm",
    "sample_order",
    "segment_loss",
    "stack",
    "train_step",
    "tunix_loss",
]
