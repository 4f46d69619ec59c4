"""``hf_optimizer``: the HF Trainer's optimizer step, read from TrainingArguments, as one Optax transformation."""

import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import optax

from gemport.errors import OptimizerConfigError
from gemport.optim.accumulation import accumulate_tokens
from gemport.optim.adam import scale_by_torch_adam
from gemport.optim.clipping import clip_grad_norm
from gemport.optim.decay import decay_mask
from gemport.optim.schedules import hf_schedule
from gemport._src.options import one_of
from gemport.recipe import DEFAULT_ONLY, OptimizerFields, defaults, given

# The fields read are gemport.recipe.OptimizerFields (and DEFAULT_ONLY where given), their defaults transformers'
# TrainingArguments'. Note the pitfalls: weight decay 0.0 (optax.adamw: 1e-4, torch AdamW: 1e-2) and clipping on at
# 1.0 (optax.adamw: none).

_NUMBERS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "warmup_steps",
)

# Ranges [low, high) that torch.optim.AdamW enforces.
_RANGES = (
    ("learning_rate", 0.0, math.inf),
    ("adam_epsilon", 0.0, math.inf),
    ("adam_beta1", 0.0, 1.0),
    ("adam_beta2", 0.0, 1.0),
    ("weight_decay", 0.0, math.inf),
)

Optim = Literal["adamw_torch", "adamw_torch_fused"]
"""The ``optim`` values ``hf_optimizer`` reproduces: torch.optim.AdamW under both names (Optax's adamw computes
the same update, save its float32 bias corrections: ``gemport.optim.adam``)."""


class HFOptimizer(NamedTuple):
    """What ``hf_optimizer`` returns.

    tx: the optimizer step, applied once per accumulated batch to the gradient of the batch's mean token loss
        (the mean over the targets of all its micro-batches): what ``step.train_step`` and
        ``run.trainer.HFPeftTrainer`` take, whatever ``gradient_accumulation_steps`` is.
    schedule: the learning rate of each optimizer step.
    accumulation: ``gradient_accumulation_steps``, the micro-batches A of one optimizer step.
    """

    tx: optax.GradientTransformationExtraArgs
    schedule: optax.Schedule
    accumulation: int

    @property
    def per_micro_batch(self) -> optax.GradientTransformationExtraArgs:
        """``tx`` for a loop that calls ``update`` once per micro-batch: ``accumulate_tokens(tx, accumulation)``,
        whose ``update`` takes the gradient of each micro-batch's summed token loss and ``num_tokens=``, and
        steps ``tx`` on every ``accumulation``-th call."""
        return accumulate_tokens(self.tx, self.accumulation)


def _fields(training_args_or_dict: Any) -> OptimizerFields:
    if not isinstance(training_args_or_dict, Mapping) and not hasattr(training_args_or_dict, "learning_rate"):
        raise OptimizerConfigError(
            f"{training_args_or_dict!r:.80} is neither TrainingArguments nor a dict of its fields; pass one of those"
        )
    return OptimizerFields.from_config(training_args_or_dict)


def _warmup_steps(fields: OptimizerFields, num_training_steps: int) -> int:
    # Older TrainingArguments move a set warmup_ratio into warmup_steps; below 1 it is a ratio.
    warmup = fields.warmup_steps if fields.warmup_ratio is None else fields.warmup_ratio
    if warmup < 0:
        raise OptimizerConfigError(f"warmup_steps must be >= 0, got {warmup}.")
    return int(warmup) if warmup >= 1 else math.ceil(num_training_steps * warmup)


def _fixed_mask(params: optax.Params):
    """``decay_mask(params)``, computed now, refusing (typed) a tree of another structure at ``init``/``update``."""
    mask, structure = decay_mask(params), jax.tree.structure(params)

    def fixed(tree):
        if jax.tree.structure(tree) != structure:
            raise OptimizerConfigError(
                f"the optimizer's weight-decay mask was fixed by hf_optimizer(params=...) for {structure.num_leaves} "
                f"params, but it is given a tree of {jax.tree.structure(tree).num_leaves} of another structure; "
                "pass the same params to hf_optimizer, or omit params= so the mask is computed from what init gets"
            )
        return mask

    return fixed


def hf_optimizer(training_args_or_dict: Any, *, num_training_steps: int,
                 params: optax.Params | None = None) -> HFOptimizer:
    """Map HF ``TrainingArguments`` to the Optax transformation of the HF Trainer's optimizer step.

    ``tx`` reproduces, in order, HF's gradient clipping (``max_grad_norm``), torch's AdamW (``optim``
    ``adamw_torch``/``adamw_torch_fused``, decay masked by ``decay_mask``) and HF's schedule (``hf_schedule``).
    ``gradient_accumulation_steps`` does not change ``tx``: it is returned as ``accumulation``;
    ``per_micro_batch`` is the transformation for a loop that updates once per micro-batch. See
    docs/optim.md#the-transformation-in-order.

    Args:
      training_args_or_dict: ``TrainingArguments`` / ``SFTConfig`` / ``DPOConfig``, or a dict of their fields,
        read as ``gemport.recipe.OptimizerFields`` (absent keys at the installed ``TrainingArguments``' defaults).
      num_training_steps: the optimizer steps of the run (``Trainer.create_scheduler``'s).
      params: the pytree the optimizer will update (any leaf shapes), to fix the weight-decay mask now; default:
        the mask is computed from what ``init`` gets.

    Returns:
      ``HFOptimizer(tx, schedule, accumulation)``: ``tx`` an Optax transformation of gradient pytrees shaped as
      the params; ``schedule(step)`` the learning rate, a float32 scalar; ``accumulation`` an int.

    Raises:
      OptimizerConfigError: a setting it cannot reproduce (docs/optim.md#what-it-refuses), a value
        ``torch.optim.AdamW`` refuses, a NaN or infinite number, an argument that is neither TrainingArguments
        nor a dict, or a ``num_training_steps`` that is not a positive int.

    Example::

      >>> from gemport.optim import hf_optimizer
      >>> opt = hf_optimizer({"learning_rate": 1e-3, "warmup_steps": 2}, num_training_steps=10)
      >>> [round(float(opt.schedule(step)), 6) for step in (0, 1, 2, 6)]  # HF's linear warmup and decay
      [0.0, 0.0005, 0.001, 0.0005]
      >>> opt.accumulation
      1
    """
    fields = _fields(training_args_or_dict)
    one_of(fields.optim, Optim, "optim", OptimizerConfigError)
    for name, value in given(training_args_or_dict, DEFAULT_ONLY).items():
        default = defaults("TrainingArguments")[name]
        if value != default:
            raise OptimizerConfigError(
                f"{name}={value!r} is not supported ({DEFAULT_ONLY[name]}); leave it at {default!r}."
            )
    for name in _NUMBERS + (("warmup_ratio",) if fields.warmup_ratio is not None else ()):
        value = getattr(fields, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # PyYAML reads 2e-4 (no dot) as a string: the usual way a recipe gets here.
            raise OptimizerConfigError(f"{name} must be a number, got {value!r}.")
        if not math.isfinite(value):
            raise OptimizerConfigError(f"{name} must be a finite number, got {value!r}.")
    # torch.optim.AdamW's own checks: what it refuses, a port must not quietly run.
    for name, low, high in _RANGES:
        if not low <= getattr(fields, name) < high:
            raise OptimizerConfigError(
                f"{name}={getattr(fields, name)!r} is out of range: torch's AdamW requires {low} <= {name} < {high}."
            )
    if isinstance(num_training_steps, bool) or not isinstance(num_training_steps, int) or num_training_steps < 1:
        raise OptimizerConfigError(f"num_training_steps must be a positive int, got {num_training_steps!r}.")
    scheduler_kwargs = fields.lr_scheduler_kwargs or {}
    if not isinstance(scheduler_kwargs, Mapping):
        raise OptimizerConfigError(f"lr_scheduler_kwargs must be a dict, got {scheduler_kwargs!r}.")
    accumulation = fields.gradient_accumulation_steps
    if not (isinstance(accumulation, int) and accumulation >= 1):
        raise OptimizerConfigError(f"gradient_accumulation_steps must be a positive int, got {accumulation!r}.")

    schedule = hf_schedule(
        fields.lr_scheduler_type,
        learning_rate=fields.learning_rate,
        num_training_steps=num_training_steps,
        num_warmup_steps=_warmup_steps(fields, num_training_steps),
        **scheduler_kwargs,
    )
    # optax.adamw's pieces, with torch's bias corrections (gemport.optim.adam: optax's are ~1e-5 off in float32).
    adamw = optax.chain(
        scale_by_torch_adam(b1=fields.adam_beta1, b2=fields.adam_beta2, eps=fields.adam_epsilon),
        optax.add_decayed_weights(fields.weight_decay, decay_mask if params is None else _fixed_mask(params)),
        optax.scale_by_learning_rate(schedule),
    )
    max_grad_norm = fields.max_grad_norm
    tx = optax.chain(clip_grad_norm(max_grad_norm), adamw) if max_grad_norm > 0 else adamw
    return HFOptimizer(tx, schedule, accumulation)
