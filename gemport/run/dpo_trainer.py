"""Tunix's trainer taking TRL's DPO steps: ``HFPeftTrainer`` with DPO's loss and TRL's logged metrics.

HF's Trainer divides each DPO micro-batch's mean per-pair loss by the step's micro-batch count, so a step's
gradient is the mean of its micro-batches' gradients; ``optax.MultiSteps`` (Tunix's accumulation) takes that
mean over A micro-batches. A short last step of an epoch is padded with empty micro-batches: each micro-batch
carries its step's real count n (``MICRO_BATCHES``) and its loss is scaled by A / n, so the mean is over the
real ones, as TRL's.
"""

from typing import Any

import jax.numpy as jnp

from gemport.step.dpo import METRICS, DPOLoss, dpo_loss
from gemport.run.trainer import EXAMPLE_LOSS, HFPeftTrainer, examples_in

MICRO_BATCHES = "micro_batches_in_step"
"""The field every DPO micro-batch carries: the micro-batches of its optimizer step that hold a pair, int32 [2B]."""


def _pair_loss(model, tokens, loss_mask, segment_ids, positions, loss: DPOLoss, reference: Any):
    # A micro-batch of pairs: its mean per-pair loss and TRL's metrics as [value, 1] (both zero for one of padding),
    # and its pairs (a pair is its chosen and its rejected row).
    batch = dict(tokens=tokens, loss_mask=loss_mask, segment_ids=segment_ids, positions=positions)
    value, metrics = dpo_loss(model, batch, loss, reference)
    pairs = examples_in(segment_ids) / 2
    used = (pairs > 0).astype(jnp.float32)
    return value * used, {k: jnp.stack([v * used, used]) for k, v in metrics.items()}, pairs


def trainer_loss(loss: DPOLoss, accumulation: int, reference: Any = None):
    """``DPOPeftTrainer``'s loss (``has_aux=True``) for steps of ``accumulation`` (A) micro-batches:
    ``(model, tokens, loss_mask, segment_ids, positions, micro_batches_in_step) -> (A / n * dpo_loss float32 [],
    {name in METRICS: float32 [2] = [value, 1]})``, both zero for a micro-batch of padding (n: its step's real
    micro-batches, ``MICRO_BATCHES``). ``reference``: ``step.dpo_loss``'s."""

    def fn(model, tokens, loss_mask, segment_ids, positions, micro_batches_in_step, **_):
        value, metrics, _ = _pair_loss(model, tokens, loss_mask, segment_ids, positions, loss, reference)
        scale = accumulation / jnp.maximum(jnp.max(micro_batches_in_step), 1).astype(jnp.float32)
        return value * scale, metrics

    return fn


def eval_loss(loss: DPOLoss, reference: Any = None):
    """``DPOPeftTrainer``'s eval loss: ``(model, tokens, loss_mask, segment_ids, positions, **_) -> (an eval batch's
    mean per-pair DPO loss float32 [], as TRL's prediction_step computes it; {name in METRICS: float32 [2] =
    [value, 1]} (TRL averages them over the batches), ``EXAMPLE_LOSS``: [loss x pairs, pairs] (HF's eval_loss
    weighs a batch by its pairs))``, zero for a batch of padding. ``reference``: ``step.dpo_loss``'s."""

    def fn(model, tokens, loss_mask, segment_ids, positions, **_):
        value, metrics, pairs = _pair_loss(model, tokens, loss_mask, segment_ids, positions, loss, reference)
        return value, {**metrics, EXAMPLE_LOSS: jnp.stack([value * pairs, pairs])}

    return fn


class DPOPeftTrainer(HFPeftTrainer):
    """``HFPeftTrainer`` whose loss is TRL's DPO loss (``trainer_loss``) and whose logged metrics are TRL's
    (``step.METRICS``, each the mean over the step's real micro-batches, beside ``loss`` and ``grad_norm``; in
    evaluation each batch's mean, averaged over the batches as TRL and HF average them).
    loss: ``DPOLoss``; reference: ``step.dpo_loss``'s (None: the base, LoRA off)."""

    LOGGED = METRICS

    def __init__(self, model, optimizer, training_config, *, loss: DPOLoss, reference: Any = None, **kwargs):
        super().__init__(model, optimizer, training_config, **kwargs)
        accumulation = training_config.get_with_default("gradient_accumulation_steps", 1)
        self.with_loss_fn(trainer_loss(loss, accumulation, reference), has_aux=True)
        self.eval_loss_fn = eval_loss(loss, reference)


__all__ = ["MICRO_BATCHES", "DPOPeftTrainer", "eval_loss", "trainer_loss"]
