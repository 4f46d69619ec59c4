"""A dataset read as a stream, as HF's Trainer and TRL's SFTTrainer read an ``IterableDataset``.

``dataset_streaming`` (TRL's ``ScriptArguments``) hands the trainer a ``datasets.IterableDataset``: prepared lazily in
stream order (packed 1000 examples at a time), no sampler, steps of ``gradient_accumulation_steps`` consecutive
micro-batches, ``max_steps`` required, the stream read again from its start for each pass. A pass's left-over
micro-batches (fewer than a step) are skipped with a warning, where HF adds their gradient to the next pass's first
step. See docs/sft.md#data-at-scale.

``StreamBatches`` is the sequence of step batches, built as the stream is read (one thread reads ahead of the
trainer: ``run.trainer.prefetched``); nothing of the stream is cached, so a resume reads and prepares it again up to
the step it resumes from.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from gemport.errors import RecipeError
from gemport.data import formats
from gemport.data.dataset import Options, check_source, fitted
from gemport.data.flat import FlatExamples
from gemport.data.order import OptimizerStep
from gemport.data.packing import TRL_PACKING_BATCH, Labelled, best_fit, check_packable, packed_rows
from gemport.data.steps import PerStep, empty_rows, lay_out, micro_batch
from gemport.data.truncation import TruncationReport
from gemport.recipe import DataFields, OrderFields

CACHED_STEPS = 4
"""Steps a ``StreamBatches`` keeps once built (the one being read, the next, and two back for a reader that
looks again): what it holds whatever the stream's length."""


@dataclasses.dataclass(frozen=True)
class Stream:
    """``source`` (anything ``formats.read`` takes) read as a stream: in order, without a length, from its start
    again for each pass, as TRL reads a ``datasets.IterableDataset``. ``gemport sft`` wraps ``dataset_name`` in
    one under ``dataset_streaming: true``."""

    source: Any


def streamed(source: Any) -> bool:
    """Whether ``source`` is read as a stream: a ``Stream``, or an iterable without a length (a
    ``datasets.IterableDataset``, a generator), which HF's Trainer too gives no sampler."""
    return isinstance(source, Stream) or (hasattr(source, "__iter__") and not hasattr(source, "__len__")
                                          and not isinstance(source, (str, os.PathLike)))


class Unit(NamedTuple):
    """What HF's dataloader takes one of per row: a packed row (``Rows`` fields [T]) or an example (``Stored``),
    with its tokens and its targets after its first token."""

    laid: Any
    tokens: int
    targets: int


class StreamStep(NamedTuple):
    """One optimizer step read from the stream: its ``OptimizerStep`` (each micro-batch's units by position in
    the pass), its micro-batches (this process's rows, ``BATCH_FIELDS`` [B, T] each), its targets and tokens over
    every row, and HF's ``epoch`` after it."""

    plan: OptimizerStep
    micro: tuple[dict[str, np.ndarray], ...]
    targets: int
    tokens: int
    epoch: float


class StreamBatches(Sequence[dict[str, np.ndarray]]):
    """The batch of each of ``max_steps`` optimizer steps on a stream, mapping ``BATCH_FIELDS`` to [A, B, T],
    built as the stream is read (``CACHED_STEPS`` kept); reading a step before those starts the stream again.

    Args:
      pipeline: the recipe's ``SFTPipeline`` (its rendering, truncation, layout, pad id and ``config``).
      source: the records: a ``Stream``, or an iterable without a length.
      tokenizer: the fast tokenizer.
      part: only these rows of every micro-batch (``data.distributed.process_rows``), under ``jax.distributed``.
      check: ``dataset.check_source``'s template check of the stream's first records.

    T is fixed ahead, as a stream's examples are not: ``max_length`` packed or padded, ``B * max_length``
    padding-free (rounded up to ``pad_to_multiple_of``).

    Raises:
      RecipeError: no ``max_steps`` (a stream has no length: HF's Trainer raises too), no ``max_length``, ``part``
        with ``padding_free``, or a stream that holds less than one step.
    """

    def __init__(self, pipeline: Any, source: Any, tokenizer: Any, *, part: slice | None = None,
                 check: str | None = "warn") -> None:
        order = OrderFields.from_config(pipeline.config)
        fields = DataFields.from_config(pipeline.config)
        if not order.max_steps or order.max_steps <= 0:
            raise RecipeError("the training data is a stream (an IterableDataset, dataset_streaming), which has no "
                              "length: set max_steps, as HF's Trainer requires")
        if pipeline.max_length is None:
            raise RecipeError("the training data is a stream, whose longest example is not known ahead: set "
                              "max_length (every step's rows are that long)")
        if part is not None and pipeline.layout == "padding_free":
            raise RecipeError("SFTConfig.padding_free lays each micro-batch out as one row, which cannot be split "
                              "over processes; use packing or padding under jax.distributed")
        self.pipeline, self.source, self.tokenizer, self.part = pipeline, _records(source), tokenizer, part
        self.max_steps, self.accumulation = order.max_steps, fields.gradient_accumulation_steps
        self.batch_size = fields.per_device_train_batch_size
        count = 1 if pipeline.layout == "padding_free" else self.batch_size
        self.rows = count if part is None else len(range(count)[part])
        longest = pipeline.max_length * (self.batch_size if pipeline.layout == "padding_free" else 1)
        multiple = pipeline.pad_to_multiple_of or 1
        self.width = pipeline.max_length if pipeline.layout == "pack" else math.ceil(longest / multiple) * multiple
        self.options = Options(pipeline.chat_format, policy=pipeline.policy,
                               completion_only_loss=pipeline.completion_only_loss, text_field=pipeline.text_field,
                               eos_token=pipeline.eos_token if pipeline.eos_token is not None
                               else getattr(tokenizer, "eos_token", None))
        check_source(formats.located(self.source), tokenizer, self.options, check=check)
        head, self.report = next(self._prepared(), ([], TruncationReport()))
        if not head:
            raise RecipeError(f"the training stream holds no example (after truncation at max_length "
                              f"{pipeline.max_length}: {self.report})")
        self.head = FlatExamples.of(head)
        self.plan = StreamPlan(self)
        self._lock = threading.Lock()
        self._kept: dict[int, StreamStep] = {}
        self._steps: Iterator[StreamStep] | None = None
        self._next = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """(A, B, T) of every step's batch, B this process's rows."""
        return self.accumulation, self.rows, self.width

    def __len__(self) -> int:
        return self.max_steps

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        micro = self.read(s).micro
        return {k: np.stack([m[k] for m in micro]) for k in micro[0]}

    def micro(self, s: int, a: int) -> dict[str, np.ndarray]:
        """Micro-batch ``a`` of step ``s``: ``BATCH_FIELDS`` [B, T] of this process's rows."""
        return self.read(s).micro[a]

    def targets(self, s: int) -> int:
        """Step s's targets over every process's rows (HF's ``num_items_in_batch``)."""
        return self.read(s).targets

    def tokens(self, s: int) -> int:
        """Step s's tokens over every process's rows."""
        return self.read(s).tokens

    def step(self, s: int) -> OptimizerStep:
        """Step s's ``OptimizerStep``, each micro-batch's units by position in its pass, cut to ``part``."""
        step = self.read(s).plan
        if self.part is None:
            return step
        return step._replace(micro_batches=tuple(m[self.part] for m in step.micro_batches))

    def read(self, s: int) -> StreamStep:
        """Step ``s`` (``StreamStep``), reading the stream up to it (from its start again for a step before those
        kept)."""
        s = range(len(self))[s]
        with self._lock:
            if s not in self._kept:
                if self._steps is None or s < self._next:
                    self._steps, self._next = self._stepped(), 0
                    self._kept.clear()
                while self._next <= s:
                    self._kept[self._next] = next(self._steps)
                    self._kept.pop(self._next - CACHED_STEPS, None)
                    self._next += 1
            return self._kept[s]

    def _prepared(self) -> Iterator[tuple[list[Labelled], TruncationReport]]:
        # One pass: the kept examples of each TRL_PACKING_BATCH records, in stream order.
        for part in formats.parts(self.source, TRL_PACKING_BATCH):
            examples, report = fitted(part.read(self.source), self.tokenizer, self.pipeline.truncation, self.options,
                                      first_index=part.first, progress=False)
            yield [(e.tokens, e.loss_mask) for e in examples], report

    def _units(self) -> Iterator[Unit]:
        # One pass's units in order; packed TRL_PACKING_BATCH examples at a time, as TRL packs a stream.
        if self.pipeline.layout != "pack":
            for examples, _ in self._prepared():
                yield from self._laid(examples)
            return
        pending: list[Labelled] = []
        for examples, _ in self._prepared():
            pending += examples
            while len(pending) >= TRL_PACKING_BATCH:
                yield from self._laid(pending[:TRL_PACKING_BATCH])
                pending = pending[TRL_PACKING_BATCH:]
        if pending:
            yield from self._laid(pending)

    def _laid(self, examples: list[Labelled]) -> Iterator[Unit]:
        targets = np.array([np.count_nonzero(m[1:]) for _, m in examples], np.int64)
        lengths = np.array([len(t) for t, _ in examples], np.int64)
        if self.pipeline.layout != "pack":
            for e, n, t in zip(examples, lengths.tolist(), targets.tolist()):
                yield Unit(e, n, t)
            return
        check_packable(lengths, np.array([bool(m[0]) for _, m in examples]), self.width, "pack")
        placement = best_fit(lengths, self.width)
        rows = packed_rows(examples, placement, np.arange(placement.rows), self.width)
        for r in range(placement.rows):
            placed = placement.order[placement.row_offsets[r]:placement.row_offsets[r + 1]]
            yield Unit({k: v[r] for k, v in rows.items()}, int(lengths[placed].sum()), int(targets[placed].sum()))

    def _stepped(self) -> Iterator[StreamStep]:
        # HF's steps over passes of the stream: A consecutive micro-batches of B consecutive units (a pass's last
        # micro-batch shorter).
        step, epoch = 0, 0
        while True:
            batches: list[list[Unit]] = []
            current: list[Unit] = []
            done = produced = 0
            for unit in itertools.chain(self._units(), [None]):
                if unit is not None:
                    current.append(unit)
                    if len(current) < self.batch_size:
                        continue
                if current:
                    batches.append(current)
                    current = []
                if len(batches) < self.accumulation:
                    continue
                done += len(batches)
                yield self._step(step, epoch, batches, done)
                step, produced, batches = step + 1, produced + 1, []
                if step == self.max_steps:
                    return
            if batches:
                warnings.warn(f"the training stream's pass {epoch} ends with {len(batches)} micro-batches, fewer "
                              f"than gradient_accumulation_steps={self.accumulation}: HF's Trainer adds their "
                              "gradient to the next pass's first step; gemport's steps have "
                              f"{self.accumulation} micro-batches, so they are skipped", stacklevel=2)
            if not produced:
                raise RecipeError(f"the training stream holds fewer than one step of "
                                  f"gradient_accumulation_steps={self.accumulation} micro-batches of "
                                  f"per_device_train_batch_size={self.batch_size} rows; give more data, or smaller "
                                  "batches")
            epoch += 1

    def _step(self, step: int, epoch: int, batches: list[list[Unit]], done: int) -> StreamStep:
        micro, positions, first = [], [], done - len(batches)
        for m, units in enumerate(batches):
            mine = units if self.part is None else units[self.part]
            position = (first + m) * self.batch_size
            positions.append(np.arange(position, position + len(units), dtype=np.int64))
            if not mine:
                micro.append(empty_rows(self.rows, self.width))
            elif self.pipeline.layout == "pack":
                micro.append(micro_batch(self.rows, self.width,
                                         {k: np.stack([u.laid[k] for u in mine]) for k in mine[0].laid}))
            else:
                laid = lay_out(self.pipeline.layout, [u.laid for u in mine], self.width, self.pipeline.pad_id)
                micro.append(micro_batch(self.rows, self.width, laid))
        targets = sum(u.targets for units in batches for u in units)
        tokens = sum(u.tokens for units in batches for u in units)
        return StreamStep(OptimizerStep(step, epoch, tuple(positions)), tuple(micro), targets, tokens,
                          epoch + done / (self.max_steps * self.accumulation))


def _records(source: Any) -> Any:
    return source.source if isinstance(source, Stream) else source


class StreamPlan(Sequence[OptimizerStep]):
    """The ``OptimizerStep``s of a ``StreamBatches`` (each micro-batch's units by position in its pass), read from
    the stream as its batches are; ``num_samples`` is None (a stream has no length)."""

    num_samples = None

    def __init__(self, batches: StreamBatches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        return self.batches.read(s).plan

    def epochs(self) -> Sequence[float]:
        """HF's ``epoch`` after each step (read when asked: after the step was read from the stream)."""
        return PerStep(len(self), lambda s: self.batches.read(s).epoch)


__all__ = ["CACHED_STEPS", "Stream", "StreamBatches", "StreamPlan", "StreamStep", "Unit", "streamed"]
