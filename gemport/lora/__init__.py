"""LoRA between PEFT and Qwix: one config (`LoraSpec`) and where each PEFT target lands in a Tunix model."""

from gemport.lora.config import PROJECTIONS, VLLM_RANKS, LoraSpec, Target, apply_lora, targets

__all__ = ["PROJECTIONS", "VLLM_RANKS", "LoraSpec", "Target", "apply_lora", "targets"]
