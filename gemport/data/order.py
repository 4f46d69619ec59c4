"""The HF Trainer's sample order and micro-batch grouping, without torch.

HF's Trainer (transformers 5.12, through accelerate) draws a ``RandomSampler`` order with a
``SeedableRandomSampler``: epoch ``e`` is ``torch.randperm(n, generator=torch.Generator().manual_seed(s + e))``
with ``s`` the ``data_seed``, or else ``seed`` (``set_seed(seed)`` makes it torch's initial seed). For
``n`` below 2**32 / 20, torch's CPU ``randperm`` is a Fisher-Yates shuffle driven by the 32-bit outputs of
an MT19937 seeded with ``seed mod 2**32``; numpy's legacy MT19937 seeding is the same generator, so the
order is reproduced here without torch.
"""

import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple, overload

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


class StepPlan(Sequence[OptimizerStep]):
    """Every optimizer step of HF's Trainer on a map-style dataset of ``num_samples`` rows, in order, each built
    when read: ``plan[s]`` is step s's ``OptimizerStep``.

    Reads ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``seed``, ``data_seed``,
    ``train_sampling_strategy``, ``max_steps``, ``num_train_epochs`` and ``dataloader_drop_last``
    (``gemport.recipe.OrderFields``) from a ``TrainingArguments`` / ``SFTConfig`` or a dict (absent keys take the
    installed ``TrainingArguments``' defaults), on one process. Each epoch's order is ``sample_order``, cut into
    micro-batches and grouped into steps as HF's Trainer does; only the last two epochs' orders (int64
    [num_samples] each) are held. See docs/train.md#the-sample-order.

    Args:
      training_args_or_dict: ``TrainingArguments`` / ``SFTConfig``, or a dict of their fields.
      num_samples: the rows of the dataset (examples, or packed rows).

    Raises:
      RecipeError: a batch size or accumulation that is not a positive int, no row, or no whole batch under
        ``dataloader_drop_last``.
    """

    def __init__(self, training_args_or_dict: Any, num_samples: int) -> None:
        f = OrderFields.from_config(training_args_or_dict)
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if not (isinstance(getattr(f, name), int) and getattr(f, name) >= 1):
                raise RecipeError(f"{name} must be a positive int, got {getattr(f, name)!r}")
        if num_samples < 1:
            raise RecipeError(f"optimizer_steps: the dataset has {num_samples} rows")
        self.num_samples = num_samples
        self.batch_size, self.accumulation = f.per_device_train_batch_size, f.gradient_accumulation_steps
        self.micro_per_epoch = micro_batches_per_epoch(num_samples, self.batch_size, f.dataloader_drop_last)
        if self.micro_per_epoch == 0:
            raise RecipeError(f"dataloader_drop_last with {num_samples} rows < per_device_train_batch_size "
                              f"{self.batch_size}: no batch")
        self.steps_per_epoch = max(-(-self.micro_per_epoch // self.accumulation), 1)
        max_steps = f.max_steps
        if not max_steps or max_steps <= 0:
            max_steps = int(np.ceil(f.num_train_epochs * self.steps_per_epoch))
        self.max_steps = max_steps
        self.seed = f.seed if f.data_seed is None else f.data_seed
        self.strategy = f.train_sampling_strategy
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.max_steps

    @overload
    def __getitem__(self, s: int) -> OptimizerStep: ...

    @overload
    def __getitem__(self, s: slice) -> list[OptimizerStep]: ...

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        s = range(len(self))[s]  # negative indices, and an IndexError past the end
        epoch, first = divmod(s, self.steps_per_epoch)
        order = self.order(epoch)
        micro = range(first * self.accumulation, min((first + 1) * self.accumulation, self.micro_per_epoch))
        return OptimizerStep(s, epoch, tuple(order[m * self.batch_size:(m + 1) * self.batch_size] for m in micro))

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (``sample_order``), int64 [num_samples]."""
        with self._lock:
            if epoch not in self._orders:
                if len(self._orders) == 2:  # the older of the two kept goes
                    del self._orders[next(iter(self._orders))]
                self._orders[epoch] = sample_order(self.num_samples, seed=self.seed, epoch=epoch,
                                                   strategy=self.strategy)
            return self._orders[epoch]

    def largest(self, values: np.ndarray) -> int:
        """The largest sum of ``values`` (one per row, int [num_samples]) over the rows of one micro-batch of the
        plan: each epoch's order drawn once, its micro-batches summed together."""
        values = np.asarray(values, np.int64)
        best = 0
        for epoch in range(-(-len(self) // self.steps_per_epoch)):
            steps = min(len(self) - epoch * self.steps_per_epoch, self.steps_per_epoch)
            micro = min(steps * self.accumulation, self.micro_per_epoch)
            order = self.order(epoch)[:min(micro * self.batch_size, self.num_samples)]
            sums = np.add.reduceat(values[order], np.arange(0, len(order), self.batch_size))
            best = max(best, int(sums.max()))
        return best

    def epochs(self) -> np.ndarray:
        """Each step's epoch as HF counts it, float64 [len(self)]: micro-batches done over an epoch's micro-batches
        (computed from the geometry: no order is drawn)."""
        s = np.arange(len(self))
        epoch, first = np.divmod(s, self.steps_per_epoch)
        done = np.minimum((first + 1) * self.accumulation, self.micro_per_epoch)
        return epoch + done / self.micro_per_epoch


def optimizer_steps(training_args_or_dict: Any, num_samples: int) -> Iterator[OptimizerStep]:
    """Every optimizer step of HF's Trainer on a map-style dataset of ``num_samples`` rows, in order: the steps of
    ``StepPlan`` (its arguments, fields and errors), one at a time.

    Returns:
      An iterator of ``OptimizerStep(step, epoch, micro_batches)``, each micro-batch int64 [<= batch size].

    Example::

      >>> from gemport.data import optimizer_steps
      >>> recipe = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_train_epochs": 1}
      >>> [(s.step, [m.tolist() for m in s.micro_batches]) for s in optimizer_steps(recipe, num_samples=6)]
      [(0, [[0, 3], [2, 4]]), (1, [[1, 5]])]
    """
    return iter(StepPlan(training_args_or_dict, num_samples))
