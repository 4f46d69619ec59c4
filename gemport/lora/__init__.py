"""LoRA between PEFT and Qwix, trained as PEFT trains it.

- `LoraSpec` (``config``): a PEFT LoRA configuration (rank, alpha, targets, patterns, initialisation);
  `LoraParams`: factors with the spec that shapes them.
- `LoraLayout` / `Adapter` (``layout``): where it lands on a Tunix Gemma model and how each factor is shaped
  and sharded; the one source for loading, exporting, sharding and memory plans.
- `apply_lora` / `Provider` (``qwix``): Qwix LoRA with PEFT's factors on fused modules and PEFT's
  initialisation; `lora_dropout` / `dropout_key`: PEFT's LoRA dropout in a training step, from a seeded key.
- `QLoraSpec` (``qlora``): a QLoRA recipe's bitsandbytes 4-bit base as the Qwix NF4 base gemport loads
  (`gemport.checkpoint.quantize`).
"""

import importlib

from gemport.lora.config import PROJECTIONS, VLLM_RANKS, LoraParams, LoraSpec
from gemport.lora.layout import Adapter, LoraLayout, factor_axes, factor_specs
from gemport.lora.qlora import QLoraSpec

# Qwix (and JAX with it) loads on first use of these, so that planning and configs do without it.
_QWIX = ("Provider", "apply_lora", "dropout_key", "lora_dropout", "provider")


def __getattr__(name):
    if name in _QWIX:
        value = getattr(importlib.import_module("gemport.lora.qwix"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gemport.lora' has no attribute {name!r}")

__all__ = [
    "PROJECTIONS",
    "VLLM_RANKS",
    "Adapter",
    "LoraLayout",
    "LoraParams",
    "LoraSpec",
    "Provider",
    "QLoraSpec",
    "apply_lora",
    "dropout_key",
    "factor_axes",
    "factor_specs",
    "lora_dropout",
    "provider",
]
