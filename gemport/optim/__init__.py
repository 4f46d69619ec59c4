"""Optimizer porting: the HF Trainer's AdamW step (schedule, decay exclusions, clipping, accumulation) in Optax."""

from gemport.optim.accumulation import AccumulateTokensState, accumulate_tokens
from gemport.optim.clipping import clip_grad_norm
from gemport.optim.decay import decay_mask, decays
from gemport.optim.hf import HFOptimizer, Optim, hf_optimizer
from gemport.optim.schedules import ScheduleName, hf_schedule

__all__ = [
    "AccumulateTokensState",
    "HFOptimizer",
    "Optim",
    "ScheduleName",
    "accumulate_tokens",
    "clip_grad_norm",
    "decay_mask",
    "decays",
    "hf_optimizer",
    "hf_schedule",
]
