"""HF learning-rate schedules (``lr_scheduler_type``) as Optax schedules.

Each HF schedule is a ``LambdaLR``: at optimizer step ``t`` (counted from 0, so the first step of
a warmup runs at learning rate 0) the learning rate is ``learning_rate * factor(t)``, computed in
Python floats. Evaluating the same factor in float32 inside a jitted step drifts where cosines
cancel (near the end of a decay, at each restart), so the schedule here is HF's factor evaluated
in float64 once per step and stored as a float32 table: every step's learning rate is HF's,
rounded once to float32.
"""

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gemport.errors import OptimizerConfigError
from gemport._src.options import one_of

ScheduleName = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
"""The ``lr_scheduler_type`` values ``hf_schedule`` reproduces."""


def _warmup(step, warmup):
    return step / max(1, warmup)


def _progress(step, warmup, total):
    return (step - warmup) / max(1, total - warmup)


def _linear(step, warmup, total):
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step, warmup, total, num_cycles):
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * _progress(step, warmup, total))))


def _cosine_with_restarts(step, warmup, total, num_cycles):
    if step < warmup:
        return _warmup(step, warmup)
    progress = _progress(step, warmup, total)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step, warmup, total, lr_end, power, learning_rate):
    if step < warmup:
        return _warmup(step, warmup)
    remaining = 1 - (step - warmup) / (total - warmup)
    return ((learning_rate - lr_end) * remaining**power + lr_end) / learning_rate


def _constant(step, warmup, total):
    return 1.0


def _constant_with_warmup(step, warmup, total):
    return _warmup(step, warmup) if step < warmup else 1.0


# name -> (factor, the lr_scheduler_kwargs HF accepts for it with their HF defaults)
_SCHEDULES: dict[ScheduleName, tuple] = {
    "linear": (_linear, {}),
    "cosine": (_cosine, {"num_cycles": 0.5}),
    "cosine_with_restarts": (_cosine_with_restarts, {"num_cycles": 1}),
    "polynomial": (_polynomial, {"lr_end": 1e-7, "power": 1.0}),
    "constant": (_constant, {}),
    "constant_with_warmup": (_constant_with_warmup, {}),
}


def hf_schedule(lr_scheduler_type: ScheduleName, *, learning_rate: float, num_training_steps: int,
                num_warmup_steps: int = 0, **scheduler_kwargs: float) -> optax.Schedule:
    """Map HF's ``lr_scheduler_type`` (as built by ``transformers.get_scheduler``) to an Optax schedule.

    ``schedule(t)`` is the learning rate of optimizer step ``t`` (0-based; Optax's count), equal to
    HF's ``scheduler.get_last_lr()`` before its ``t``-th ``optimizer.step()``, rounded to float32; past
    ``num_training_steps`` it holds its value at the last step. Each schedule's formula:
    docs/optim.md#the-schedules-formulas.

    Args:
      lr_scheduler_type: ``linear``, ``cosine``, ``cosine_with_restarts``, ``polynomial``, ``constant`` or
        ``constant_with_warmup`` (or HF's ``SchedulerType`` enum).
      learning_rate, num_training_steps, num_warmup_steps: HF's (warmup ramps ``t / max(1, w)`` from 0).
      **scheduler_kwargs: HF's ``lr_scheduler_kwargs`` (``num_cycles``, ``lr_end``, ``power``).

    Raises:
      OptimizerConfigError: a name or keyword not listed above.
    """
    name = one_of(getattr(lr_scheduler_type, "value", lr_scheduler_type), ScheduleName, "lr_scheduler_type",
                  OptimizerConfigError)
    factor, defaults = _SCHEDULES[name]
    unknown = sorted(set(scheduler_kwargs) - set(defaults))
    if unknown:
        accepted = sorted(defaults) or "none"
        raise OptimizerConfigError(
            f"lr_scheduler_kwargs {unknown} are not supported for lr_scheduler_type {name!r}; "
            f"it accepts: {accepted}."
        )
    if not (isinstance(num_training_steps, int) and num_training_steps >= 1):
        raise OptimizerConfigError(f"num_training_steps must be a positive int, got {num_training_steps!r}.")
    if not (isinstance(num_warmup_steps, int) and num_warmup_steps >= 0):
        raise OptimizerConfigError(f"num_warmup_steps must be a non-negative int, got {num_warmup_steps!r}.")
    kwargs = {**defaults, **scheduler_kwargs}
    if name == "polynomial":
        if not learning_rate > kwargs["lr_end"]:
            raise OptimizerConfigError(
                f"polynomial needs learning_rate > lr_end, got {learning_rate} and {kwargs['lr_end']}."
            )
        if num_warmup_steps == num_training_steps:
            raise OptimizerConfigError(
                "polynomial with num_warmup_steps == num_training_steps divides by zero in HF after the "
                "last step; use constant_with_warmup, which has the same learning rates."
            )
        kwargs["learning_rate"] = learning_rate

    factors = [factor(t, num_warmup_steps, num_training_steps, **kwargs) for t in range(num_training_steps)]
    table = np.array([learning_rate * f for f in factors], dtype=np.float32)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        return jnp.asarray(table)[jnp.minimum(count, num_training_steps - 1)]

    return schedule
