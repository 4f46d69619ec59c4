"""hf_schedule against transformers.get_scheduler, step by step."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import get_scheduler

from gemport.errors import OptimizerConfigError
from gemport.optim import ScheduleName, hf_schedule

LR = 3e-4


def hf_learning_rates(name, num_training_steps, num_warmup_steps, kwargs):
    """The learning rate HF's scheduler gives each optimizer step, as the Trainer steps it."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = get_scheduler(
        name,
        optimizer,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=kwargs,
    )
    rates = []
    for _ in range(num_training_steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return np.array(rates)


SCHEDULES = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {}),
    ("cosine_with_restarts", {"num_cycles": 4}),
    ("polynomial", {}),
    ("polynomial", {"lr_end": 1e-5, "power": 0.5}),
    ("constant", {}),
    ("constant_with_warmup", {}),
]


@pytest.mark.parametrize("num_training_steps, num_warmup_steps", [(1, 0), (9, 0), (9, 3), (9, 9), (9, 12), (200, 20)])
@pytest.mark.parametrize("name, kwargs", SCHEDULES, ids=[f"{n}{k or ''}" for n, k in SCHEDULES])
def test_every_step_equals_hf(name, kwargs, num_training_steps, num_warmup_steps):
    if name == "polynomial" and num_warmup_steps == num_training_steps:
        with pytest.raises(ZeroDivisionError):
            hf_learning_rates(name, num_training_steps, num_warmup_steps, kwargs)
        with pytest.raises(OptimizerConfigError, match="divides by zero"):
            hf_schedule(name, learning_rate=LR, num_training_steps=9, num_warmup_steps=9)
        return
    expected = hf_learning_rates(name, num_training_steps, num_warmup_steps, kwargs).astype(np.float32)
    schedule = hf_schedule(
        name, learning_rate=LR, num_training_steps=num_training_steps, num_warmup_steps=num_warmup_steps, **kwargs
    )
    np.testing.assert_array_equal(np.asarray(schedule(jnp.arange(num_training_steps))), expected)


def test_warmup_starts_at_zero_and_is_traceable():
    schedule = hf_schedule("linear", learning_rate=1.0, num_training_steps=10, num_warmup_steps=4)
    rates = jax.jit(jax.vmap(schedule))(jnp.arange(12, dtype=jnp.int32))
    expected = [0, 0.25, 0.5, 0.75, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 1 / 6, 1 / 6]  # past step 9: held
    np.testing.assert_allclose(rates, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: hf_schedule("inverse_sqrt", learning_rate=LR, num_training_steps=5), "inverse_sqrt.*cosine"),
        (lambda: hf_schedule("linear", learning_rate=LR, num_training_steps=5, num_cycles=2), "num_cycles.*none"),
        (lambda: hf_schedule("cosine", learning_rate=LR, num_training_steps=5, min_lr=0.0), "min_lr.*num_cycles"),
        (lambda: hf_schedule("polynomial", learning_rate=1e-7, num_training_steps=5), "lr_end"),
        (lambda: hf_schedule("linear", learning_rate=LR, num_training_steps=0), "num_training_steps"),
        (lambda: hf_schedule("linear", learning_rate=LR, num_training_steps=5, num_warmup_steps=-1), "num_warmup"),
    ],
)
def test_what_it_cannot_reproduce_is_an_error(call, match):
    with pytest.raises(OptimizerConfigError, match=match):
        call()


def test_every_schedule_name_is_compared_with_hf():
    assert {name for name, _ in SCHEDULES} == set(typing.get_args(ScheduleName))
