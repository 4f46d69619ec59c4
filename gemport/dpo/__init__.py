"""Preference tuning as TRL 1.16's ``DPOTrainer`` + PEFT does it, on a Tunix Gemma with LoRA.

Data (``data``): ``preferences`` tokenizes TRL's preference records (explicit or implicit prompt, plain or
conversational) and ``collate`` lays out a micro-batch of pairs as TRL's collator does. Loss (``loss``):
``from_dpo_config`` reads a ``DPOConfig``, ``dpo_loss`` gives one micro-batch's loss and TRL's metrics, the
reference being the same model with its LoRA off (``without_lora``). Step (``trainer``): ``DPOPeftTrainer``,
the SFT trainer's one step with DPO's loss and TRL's gradient accumulation. Run (``run``): ``DPORun``, a
``trl dpo`` recipe as one object (``gemport dpo --config``), on the SFT run's primitives. Parity (``parity``):
``trajectory``, TRL's ``DPOTrainer`` + PEFT against ``DPORun`` step by step (``gemport parity --trainer dpo``).
See docs/dpo.md.
"""

from gemport.dpo.data import Preference, collate, preferences, split_prompt, tokenize
from gemport.dpo.loss import (
    METRICS,
    PAIR_LOSSES,
    DPOLoss,
    dpo_loss,
    from_dpo_config,
    preference_loss,
    sequence_logps,
    without_lora,
)
from gemport.dpo.run import DPORun

__all__ = [
    "METRICS",
    "PAIR_LOSSES",
    "DPOLoss",
    "DPORun",
    "Preference",
    "collate",
    "dpo_loss",
    "from_dpo_config",
    "preference_loss",
    "preferences",
    "sequence_logps",
    "split_prompt",
    "tokenize",
    "without_lora",
]
