"""Truncation that never silently teaches the wrong thing, and the report of what it did."""

from __future__ import annotations

import collections
import dataclasses
import typing
from collections.abc import Hashable, Mapping
from typing import Any, Literal, NamedTuple

import numpy as np

from gemport.errors import MaskError
from gemport.data.tokenize import Example
from gemport._src.options import one_of

Overflow = Literal["drop", "trim"]
"""What ``Truncation`` does with an example whose targets run past ``max_len``."""

Decision = Literal["kept", "trimmed_untrained", "trimmed", "dropped_too_long", "dropped_no_target"]
"""What truncation did to one example (see ``TruncationReport``)."""

_DECISIONS: tuple[Decision, ...] = typing.get_args(Decision)


@dataclasses.dataclass(frozen=True)
class Truncation:
    """How to fit examples into ``max_len`` tokens.

    Every cut happens at a turn boundary, so no turn, trained or not, loses its end. When the
    turns past the boundary hold no target the example is trimmed whatever ``overflow`` says;
    when they hold targets, ``overflow="drop"`` drops the example and ``overflow="trim"`` keeps the
    whole turns that fit. An example left without any target is always dropped.
    """

    max_len: int
    overflow: Overflow = "drop"

    def __post_init__(self) -> None:
        one_of(self.overflow, Overflow, "Truncation.overflow", MaskError)
        if not isinstance(self.max_len, int) or self.max_len < 2:
            raise MaskError(f"Truncation.max_len: {self.max_len!r}; need an int >= 2")


class Fitted(NamedTuple):
    """What ``truncate`` did to one example: the fitted ``Example`` (a new one when cut, None when
    dropped), the ``Decision`` and the number of trained targets it removed."""

    example: Example | None
    decision: Decision
    targets_lost: int


@dataclasses.dataclass(repr=False)
class TruncationReport:
    """Counts of every truncation decision, and of the trained targets it cost.

    counts: examples per ``Decision``, also read as attributes: ``kept`` (fitted as they were),
    ``trimmed_untrained`` (only turns without targets were cut), ``trimmed`` (turns with targets were
    cut, ``overflow="trim"``), ``dropped_too_long`` (targets lay past ``max_len``, ``overflow="drop"``),
    ``dropped_no_target`` (no target was left, or there never was one). targets_lost: trained targets
    removed by trims and drops. which: for every decision but ``kept``, the examples it was taken for,
    in input order: each is named by its key (the record's ``"id"`` when it has one, else its index in
    the input). The repr leaves ``which`` out, so it stays one line on a large dataset.
    """

    counts: collections.Counter[Decision] = dataclasses.field(default_factory=collections.Counter)
    targets_lost: int = 0
    which: dict[Decision, list[Hashable]] = dataclasses.field(default_factory=dict)

    def record(self, decision: Decision, targets_lost: int, key: Hashable | None = None) -> None:
        """Counts one ``decision`` that removed ``targets_lost`` targets, taken for the example named
        ``key`` (listed in ``which`` unless the decision is ``"kept"`` or key is None)."""
        self.counts[one_of(decision, Decision, "decision", MaskError)] += 1
        self.targets_lost += targets_lost
        if decision != "kept" and key is not None:
            self.which.setdefault(decision, []).append(key)

    def merge(self, other: TruncationReport) -> None:
        """Adds ``other``'s decisions, taken for the records after this report's (its ``which`` lists follow)."""
        self.counts.update(other.counts)
        self.targets_lost += other.targets_lost
        for decision, keys in other.which.items():
            self.which.setdefault(decision, []).extend(keys)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready ``{"counts", "targets_lost", "which"}`` (``from_json`` reads it back)."""
        return {"counts": dict(self.counts), "targets_lost": self.targets_lost, "which": self.which}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TruncationReport:
        """The report ``to_json`` wrote."""
        return cls(collections.Counter(data["counts"]), int(data["targets_lost"]),
                   {k: list(v) for k, v in data["which"].items()})

    @property
    def kept(self) -> int:
        return self.counts["kept"]

    @property
    def trimmed_untrained(self) -> int:
        return self.counts["trimmed_untrained"]

    @property
    def trimmed(self) -> int:
        return self.counts["trimmed"]

    @property
    def dropped_too_long(self) -> int:
        return self.counts["dropped_too_long"]

    @property
    def dropped_no_target(self) -> int:
        return self.counts["dropped_no_target"]

    def __repr__(self) -> str:
        counts = ", ".join(f"{decision}={self.counts[decision]}" for decision in _DECISIONS)
        return f"TruncationReport({counts}, targets_lost={self.targets_lost})"


def truncate(example: Example, truncation: Truncation) -> Fitted:
    """Applies ``truncation`` to one ``Example``; returns ``Fitted`` (example or None, decision, targets_lost)."""
    n = len(example.tokens)
    targets = int(example.loss_mask.sum())
    if n <= truncation.max_len:
        if targets == 0:
            return Fitted(None, "dropped_no_target", 0)
        return Fitted(example, "kept", 0)
    starts = np.flatnonzero(np.diff(example.turn_ids)) + 1
    cut = int(starts[starts <= truncation.max_len].max(initial=0))
    lost = int(example.loss_mask[cut:].sum())
    if lost and truncation.overflow == "drop":
        return Fitted(None, "dropped_too_long", targets)
    if lost == targets:
        return Fitted(None, "dropped_no_target", lost)
    return Fitted(Example(*(field[:cut] for field in example)), "trimmed" if lost else "trimmed_untrained", lost)
