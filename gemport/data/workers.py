"""A dataset's records rendered, masked, tokenized and fitted on every core: worker processes, results in order.

The records are cut into ``formats.parts``; each worker process prepares whole parts (``dataset.fitted``: render,
tokenize, mask, truncate, and with a custom chat template ``chat_template.check_records``) and sends back flat
arrays; the parent takes them in the data's order. Workers are forked, so they hold the source, the tokenizer and the
options without pickling them; they touch nothing of JAX (whose fork warning is for processes that do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from gemport.data import formats
from gemport.data.dataset import Options, fitted
from gemport.data.truncation import Truncation, TruncationReport
from gemport.data.chat_template import check_records

PART_SIZE = 2048
"""Records a worker prepares at a time: large enough that sending a part back costs little beside preparing it,
small enough that the parts keep every worker busy to the end."""


@dataclasses.dataclass(frozen=True)
class Job:
    """What every part is prepared with.

    Attributes:
      source: the records (what ``formats.parts`` cut).
      tokenizer: the fast tokenizer.
      truncation: the ``Truncation``.
      options: how records render (``dataset.Options``).
      template: a custom chat template's check (``chat_template.check_records``' keywords: ``tokenizer``,
        ``chat_format``, ``policy``, ``text_field``) run on each part's records first, or None.
    """

    source: Any
    tokenizer: Any
    truncation: Truncation
    options: Options
    template: dict[str, Any] | None = None


class Done(NamedTuple):
    """One prepared part: ``records`` read, its kept examples' tokens int32 [k_tokens] and loss_mask bool
    [k_tokens] end to end, lengths int64 [k], targets int32 [k] (after each first token) and the report."""

    records: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    report: TruncationReport


_JOB: Job | None = None  # the forked workers' job, set before the fork


def prepare_part(job: Job, part: formats.Part) -> Done:
    """``Done`` of one part of ``job.source``."""
    if job.template is not None:
        check_records((r for _, r in part.read(job.source)), first_index=part.first, **job.template)
    examples, report = fitted(part.read(job.source), job.tokenizer, job.truncation, job.options,
                              first_index=part.first, progress=False)
    lengths = np.fromiter((len(e.tokens) for e in examples), np.int64, len(examples))
    targets = np.fromiter((np.count_nonzero(e.loss_mask[1:]) for e in examples), np.int32, len(examples))
    tokens = np.concatenate([e.tokens for e in examples]).astype(np.int32) if examples else np.zeros(0, np.int32)
    mask = np.concatenate([e.loss_mask for e in examples]) if examples else np.zeros(0, bool)
    return Done(part.count, tokens, mask, lengths, targets, report)


def _forked(part: formats.Part) -> Done:
    return prepare_part(_JOB, part)


def prepared_parts(job: Job, *, workers: int, part_size: int = PART_SIZE) -> Iterator[Done]:
    """Every part of ``job.source`` prepared, in the data's order (``Done`` each).

    workers: processes preparing parts at once; 1, or a source of one part, prepares them in this process.
    """
    parts = formats.parts(job.source, part_size)
    head = list(itertools.islice(parts, 2))
    if workers <= 1 or len(head) < 2:
        for part in itertools.chain(head, parts):
            yield prepare_part(job, part)
        return
    global _JOB
    _JOB = job
    try:
        with _quiet_fork():
            pool = multiprocessing.get_context("fork").Pool(workers)
            finished = False
            try:
                yield from pool.imap(_forked, itertools.chain(head, parts))
                finished = True
            finally:
                # Every part back, the workers leave on close's sentinel. terminate() stops them with SIGTERM,
                # which libtpu (loaded on every TPU host) answers in each forked worker with a stack dump, or a
                # segfault where the signal lands in malloc: only a run stopped early pays that.
                if finished:
                    pool.close()
                else:
                    pool.terminate()
                pool.join()
    finally:
        _JOB = None


@contextlib.contextmanager
def _quiet_fork():
    # The workers tokenize one part each on their own core: the tokenizer's threads would only contend (and a
    # fork after they ran makes tokenizers warn), as datasets' map(num_proc=...) sets too.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with warnings.catch_warnings():
            # JAX warns at every fork since its threads would deadlock a child that used JAX; these never do.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


__all__ = ["Done", "Job", "PART_SIZE", "prepare_part", "prepared_parts"]
