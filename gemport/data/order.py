"""The HF Trainer's sample order and micro-batch grouping, without torch.

HF's Trainer (transformers 5.12, through accelerate) draws a ``RandomSampler`` order with a
``SeedableRandomSampler``: epoch ``e`` is ``torch.randperm(n, generator=torch.Generator().manual_seed(s + e))``
with ``s`` the ``data_seed``, or else ``seed`` (``set_seed(seed)`` makes it torch's initial seed). For
``n`` below 2**32 / 20, torch's CPU ``randperm`` is a Fisher-Yates shuffle driven by the 32-bit outputs of
an MT19937 seeded with ``seed mod 2**32``; numpy's legacy MT19937 seeding is the same generator, so the
order is reproduced here without torch.
"""

from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import numpy as np

from gemport.errors import RecipeError
from gemport._src.options import one_of
from gemport.recipe import OrderFields

SamplingStrategy = Literal["random", "sequential"]
"""The ``train_sampling_strategy`` values whose order gemport reproduces."""

# Above this size torch's randperm draws 64-bit numbers, which is not reproduced here.
_RANDPERM_32BIT_LIMIT = (2**32 - 1) // 20


def randperm(n: int, seed: int) -> np.ndarray:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` on CPU, as int64 [n]."""
    if not 0 <= n < _RANDPERM_32BIT_LIMIT:
        raise RecipeError(f"randperm: n={n}; gemport reproduces torch's order for 0 <= n < {_RANDPERM_32BIT_LIMIT}")
    generator = np.random.MT19937()
    generator.state = np.random.RandomState(seed % 2**32).get_state(legacy=False)
    draws = generator.random_raw(max(n - 1, 0)).tolist()
    order = list(range(n))
    for i, draw in enumerate(draws):
        j = i + draw % (n - i)
        order[i], order[j] = order[j], order[i]
    return np.array(order, dtype=np.int64)


def sample_order(num_samples: int, *, seed: int, epoch: int = 0, strategy: SamplingStrategy = "random") -> np.ndarray:
    """The order in which HF's Trainer visits ``num_samples`` training rows in ``epoch``, int64 [num_samples].

    strategy: ``TrainingArguments.train_sampling_strategy``, ``"random"`` (seeded with ``seed + epoch``,
    where ``seed`` is ``data_seed`` if set, else ``seed``) or ``"sequential"``.
    """
    if one_of(strategy, SamplingStrategy, "train_sampling_strategy", RecipeError) == "sequential":
        return np.arange(num_samples, dtype=np.int64)
    return randperm(num_samples, seed + epoch)


class OptimizerStep(NamedTuple):
    """The rows of one optimizer step: ``micro_batches[i]`` is int64 [<= batch size] row indices."""

    step: int
    epoch: int
    micro_batches: tuple[np.ndarray, ...]


def micro_batches_per_epoch(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """The micro-batches of one epoch of ``num_samples`` rows in batches of ``batch_size``, as HF's dataloader cuts
    them: the last one shorter, or dropped with ``drop_last`` (``dataloader_drop_last``)."""
    return num_samples // batch_size if drop_last else -(-num_samples // batch_size)


def optimizer_steps(training_args_or_dict: Any, num_samples: int) -> Iterator[OptimizerStep]:
    """Every optimizer step of HF's Trainer on a map-style dataset of ``num_samples`` rows, in order.

    Reads ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``seed``, ``data_seed``,
    ``train_sampling_strategy``, ``max_steps``, ``num_train_epochs`` and ``dataloader_drop_last``
    (``gemport.recipe.OrderFields``) from a ``TrainingArguments`` / ``SFTConfig`` or a dict (absent keys take the
    installed ``TrainingArguments``' defaults), on one process. Each epoch's order is ``sample_order``, cut into micro-batches of the batch size (the
    last one shorter unless ``dataloader_drop_last``); each optimizer step takes
    ``gradient_accumulation_steps`` consecutive micro-batches, the last step of an epoch the remainder.
    Training stops after ``max_steps`` steps if it is positive, else after
    ``ceil(num_train_epochs * steps_per_epoch)``. Yields ``OptimizerStep``s.

    Args:
      training_args_or_dict: ``TrainingArguments`` / ``SFTConfig``, or a dict of their fields.
      num_samples: the rows of the dataset (examples, or packed rows).

    Returns:
      An iterator of ``OptimizerStep(step, epoch, micro_batches)``, each micro-batch int64 [<= batch size].

    Example::

      >>> from gemport.data import optimizer_steps
      >>> recipe = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_train_epochs": 1}
      >>> [(s.step, [m.tolist() for m in s.micro_batches]) for s in optimizer_steps(recipe, num_samples=6)]
      [(0, [[0, 3], [2, 4]]), (1, [[1, 5]])]
    """
    f = OrderFields.from_config(training_args_or_dict)
    batch_size, accumulation = f.per_device_train_batch_size, f.gradient_accumulation_steps
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if not (isinstance(getattr(f, name), int) and getattr(f, name) >= 1):
            raise RecipeError(f"{name} must be a positive int, got {getattr(f, name)!r}")
    if num_samples < 1:
        raise RecipeError(f"optimizer_steps: the dataset has {num_samples} rows")
    micro_per_epoch = micro_batches_per_epoch(num_samples, batch_size, f.dataloader_drop_last)
    if micro_per_epoch == 0:
        raise RecipeError(
            f"dataloader_drop_last with {num_samples} rows < per_device_train_batch_size {batch_size}: no batch"
        )
    steps_per_epoch = max(-(-micro_per_epoch // accumulation), 1)
    max_steps = f.max_steps
    if not max_steps or max_steps <= 0:
        max_steps = int(np.ceil(f.num_train_epochs * steps_per_epoch))
    seed = f.seed if f.data_seed is None else f.data_seed
    step = 0
    epoch = 0
    while step < max_steps:
        order = sample_order(num_samples, seed=seed, epoch=epoch, strategy=f.train_sampling_strategy)
        micro = [order[i * batch_size:(i + 1) * batch_size] for i in range(micro_per_epoch)]
        for start in range(0, micro_per_epoch, accumulation):
            if step == max_steps:
                return
            yield OptimizerStep(step, epoch, tuple(micro[start:start + accumulation]))
            step += 1
        epoch += 1
