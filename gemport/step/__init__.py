"""The step's math: one micro-batch's loss and one optimizer step, as HF's Trainer takes them.

``train_step`` takes one optimizer step as HF's Trainer does (token-weighted gradient accumulation, HF's logged
``loss`` and pre-clip ``grad_norm``); its loss is a value: ``segment_loss`` (attention from ``segment_ids``,
chunked cross-entropy: never [T, S] scores or [B, T, V] logits) or ``tunix_loss`` (Tunix's own attention and
logits). Cross-entropy with an explicit scope:
``masked_cross_entropy``, ``summed_cross_entropy``, ``loss_scopes``. DPO's loss and TRL's metrics: ``dpo_loss``,
``from_dpo_config``, the reference being the model with its LoRA off (``without_lora``).
"""

from gemport.step.cross_entropy import loss_scopes, masked_cross_entropy, summed_cross_entropy
from gemport.step.dpo import (
    dpo_loss,
    DPOLoss,
    from_dpo_config,
    METRICS,
    PAIR_LOSSES,
    preference_loss,
    sequence_logps,
    without_lora,
)
from gemport.step.hf import segment_loss, StepMetrics, train_step, tunix_loss

__all__ = [
    "DPOLoss",
    "METRICS",
    "PAIR_LOSSES",
    "StepMetrics",
    "dpo_loss",
    "from_dpo_config",
    "loss_scopes",
    "masked_cross_entropy",
    "preference_loss",
    "segment_loss",
    "sequence_logps",
    "summed_cross_entropy",
    "train_step",
    "tunix_loss",
    "without_lora",
]
