"""Each optimizer step's batch, built when it is read, from examples in flat arrays (in memory or on disk).

A run of a million conversations has tens of thousands of steps; laid out ahead they would be the dataset again,
several times over. ``StepBatches`` is the sequence of them that holds none: ``batches[s]`` (or one micro-batch,
``micro(s, a)``) is built from the examples when asked for, and what the trainer needs of every step ahead (its
targets, its tokens) comes from per-row counts, without building it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, overload

import numpy as np

from gemport.errors import RecipeError
from gemport.data.batching import BATCH_FIELDS, pad, padding_free
from gemport.data.flat import FlatExamples
from gemport.data.order import OptimizerStep
from gemport.data.packing import Labelled, Placement, Rows, packed_rows

Layout = Literal["pack", "pad", "padding_free"]
"""A batch layout: best-fit-decreasing packed rows, one example per padded row, one padding-free row."""


def empty_rows(rows: int, width: int) -> dict[str, np.ndarray]:
    """``BATCH_FIELDS`` of ``rows`` empty rows [rows, width]: token 0, no target, segment 0, position 0 (what
    ``stack`` fills a short micro-batch with)."""
    return {k: np.zeros((rows, width), bool if k == "loss_mask" else np.int32) for k in BATCH_FIELDS}


def widen(row: Rows, width: int, pad_id: int) -> dict[str, np.ndarray]:
    """A padding-free row [1, n] padded on the right to [1, width]: ``pad_id`` tokens, never a target, segment 0,
    position 0."""
    out = {}
    for k, v in row.items():
        out[k] = np.full((1, width), pad_id if k == "tokens" else 0, v.dtype)
        out[k][:, : v.shape[1]] = v
    return out


def lay_out(layout: Layout, examples: Sequence[Labelled], width: int, pad_id: int) -> Rows:
    """One micro-batch of ``examples`` without packing: one a row padded with ``pad_id`` (``"pad"``), or all in
    one padding-free row (``"padding_free"``, ``widen``ed), each row [width]."""
    if layout == "pad":
        return pad(examples, width, pad_id=pad_id)
    return widen(padding_free(examples, pad_id=pad_id), width, pad_id)


def micro_batch(rows: int, width: int, laid: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``BATCH_FIELDS`` [rows, width]: the rows ``laid`` out first, the rest empty (``empty_rows``)."""
    out = empty_rows(rows, width)
    for k in BATCH_FIELDS:
        out[k][: len(laid[k])] = laid[k]
    return out


class PerStep(Sequence[int]):
    """A value per step, computed when read: ``values[s]`` is ``value(s)`` for s in ``range(steps)``."""

    def __init__(self, steps: int, value: Callable[[int], int]) -> None:
        self.steps, self.value = steps, value

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self.value(i) for i in range(*s.indices(self.steps))]
        return self.value(range(self.steps)[s])


class StepBatches(Sequence[dict[str, np.ndarray]]):
    """The batch of every optimizer step of ``plan``, mapping ``BATCH_FIELDS`` to [A, B, T], built when read.

    Args:
      examples: the examples the plan's units index (``FlatExamples``: in memory, or read from the
        prepared-data cache).
      plan: each step's ``OptimizerStep`` (``order.StepPlan``, or a list): the units of each micro-batch, the
        whole batch's (every process's).
      layout: ``"pack"`` (a unit is a row of ``placement``), ``"pad"`` (a unit is an example, one a row, padded
        with ``pad_id``) or ``"padding_free"`` (a micro-batch is one row of its examples, padded with ``pad_id``).
      width: T, the same for every step (so the step compiles once).
      accumulation: A, micro-batches a step.
      batch_size: B, the rows of a micro-batch (1 padding-free).
      pad_id: the token padding fills a real row with (packed rows pad with 0, as ``pack``).
      placement: the packed rows (``layout="pack"``).
      part: only these rows of every micro-batch (``data.distributed.process_rows``), as a process of a
        ``jax.distributed`` run lays them out: batches [A, part.stop - part.start, T]. Not for ``padding_free``.

    Raises:
      RecipeError: ``part`` with ``padding_free``, whose micro-batch is one row.
    """

    def __init__(self, examples: FlatExamples, plan: Sequence[OptimizerStep], *, layout: Layout, width: int,
                 accumulation: int, batch_size: int, pad_id: int, placement: Placement | None = None,
                 part: slice | None = None) -> None:
        if part is not None and layout == "padding_free":
            raise RecipeError(
                "SFTConfig.padding_free lays each micro-batch out as one row, which cannot be split over "
                "processes; use packing or padding under jax.distributed"
            )
        self.examples, self.plan, self.layout, self.width = examples, plan, layout, width
        self.accumulation, self.pad_id, self.placement, self.part = accumulation, pad_id, placement, part
        rows = 1 if layout == "padding_free" else batch_size
        self.rows = rows if part is None else len(range(rows)[part])
        if layout == "pack":
            starts = placement.row_offsets[:-1]
            # Every packed row holds at least one example, so reduceat sums each row's own.
            self.unit_targets = np.add.reduceat(examples.targets[placement.order], starts) if len(starts) else \
                np.zeros(0, np.int64)
            self.unit_tokens = np.add.reduceat(examples.lengths[placement.order], starts) if len(starts) else \
                np.zeros(0, np.int64)
        else:
            self.unit_targets, self.unit_tokens = np.asarray(examples.targets), examples.lengths

    @property
    def shape(self) -> tuple[int, int, int]:
        """(A, B, T) of every step's batch, B this process's rows."""
        return self.accumulation, self.rows, self.width

    def __len__(self) -> int:
        return len(self.plan)

    @overload
    def __getitem__(self, s: int) -> dict[str, np.ndarray]: ...

    @overload
    def __getitem__(self, s: slice) -> list[dict[str, np.ndarray]]: ...

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        s = range(len(self))[s]
        micro = [self.micro(s, a) for a in range(self.accumulation)]
        return {k: np.stack([m[k] for m in micro]) for k in BATCH_FIELDS}

    def step(self, s: int) -> OptimizerStep:
        """Step s's ``OptimizerStep``, its micro-batches cut to this process's rows (``part``)."""
        step = self.plan[s]
        if self.part is None:
            return step
        return step._replace(micro_batches=tuple(m[self.part] for m in step.micro_batches))

    def micro(self, s: int, a: int) -> dict[str, np.ndarray]:
        """Micro-batch ``a`` of step ``s``: ``BATCH_FIELDS`` [B, T] of this process's rows; the rows a short
        micro-batch (or a step's missing micro-batch) lacks are empty (token 0, no target), as ``stack`` fills
        them."""
        step = self.step(s)
        if a >= len(step.micro_batches) or not len(step.micro_batches[a]):
            return empty_rows(self.rows, self.width)
        units = step.micro_batches[a]
        if self.layout == "pack":
            laid = packed_rows(self.examples, self.placement, units, self.width)
        else:
            laid = lay_out(self.layout, [self.examples[int(i)] for i in units], self.width, self.pad_id)
        return micro_batch(self.rows, self.width, laid)

    def targets(self, s: int) -> int:
        """Step s's targets over every process's rows (HF's ``num_items_in_batch``): each row's targets after its
        first token, from the examples' counts, without building the batch."""
        return int(sum(self.unit_targets[m].sum() for m in self.plan[s].micro_batches))

    def tokens(self, s: int) -> int:
        """Step s's tokens over every process's rows (``segment_ids`` > 0 of its batch), without building it."""
        return int(sum(self.unit_tokens[m].sum() for m in self.plan[s].micro_batches))


__all__ = ["Layout", "PerStep", "StepBatches", "empty_rows", "lay_out", "micro_batch", "widen"]
