"""Truncation that never silently teaches the wrong thing, and the report of what it did."""

import dataclasses

import numpy as np

from gemport.errors import MaskError
from gemport.masks.tokenize import Example

_OVERFLOW = ("drop", "trim")


@dataclasses.dataclass(frozen=True)
class Truncation:
    """How to fit examples into ``max_len`` tokens.

    Every cut happens at a turn boundary, so no turn, trained or not, loses its end. When the
    turns past the boundary hold no target the example is trimmed whatever ``overflow`` says;
    when they hold targets, ``overflow="drop"`` drops the example and ``overflow="trim"`` keeps the
    whole turns that fit. An example left without any target is always dropped.
    """

    max_len: int
    overflow: str = "drop"

    def __post_init__(self):
        if self.overflow not in _OVERFLOW:
            raise MaskError(f"Truncation.overflow: {self.overflow!r} is not one of {_OVERFLOW}")
        if not isinstance(self.max_len, int) or self.max_len < 2:
            raise MaskError(f"Truncation.max_len: {self.max_len!r}; need an int >= 2")


@dataclasses.dataclass
class TruncationReport:
    """Counts of every truncation decision, and of the trained targets it cost.

    kept: fitted as they were. trimmed_untrained: only turns without targets were cut.
    trimmed: turns with targets were cut (``overflow="trim"``). dropped_too_long: dropped because
    targets lay past ``max_len`` (``overflow="drop"``). dropped_no_target: dropped because no
    target was left (or there never was one). targets_lost: trained targets removed by trims and drops.
    which: for every decision but ``kept``, the examples it was taken for, in input order: each is
    named by its key (the record's ``"id"`` when it has one, else its index in the input). Left out of
    the repr, which stays one line on a large dataset.
    """

    kept: int = 0
    trimmed_untrained: int = 0
    trimmed: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    targets_lost: int = 0
    which: dict = dataclasses.field(default_factory=dict, repr=False)

    def record(self, decision, targets_lost, key=None):
        """Counts one ``decision`` (a field name) that removed ``targets_lost`` targets, taken for
        the example named ``key`` (listed in ``which`` unless the decision is ``kept`` or key is None)."""
        setattr(self, decision, getattr(self, decision) + 1)
        self.targets_lost += targets_lost
        if decision != "kept" and key is not None:
            self.which.setdefault(decision, []).append(key)


def truncate(example, truncation):
    """Applies ``truncation`` to one ``Example``.

    Returns (example or None, decision, targets_lost): the fitted ``Example`` (a new one when cut;
    None when dropped), the name of the ``TruncationReport`` field it counts under, and the number
    of trained targets removed.
    """
    n = len(example.tokens)
    targets = int(example.loss_mask.sum())
    if n <= truncation.max_len:
        if targets == 0:
            return None, "dropped_no_target", 0
        return example, "kept", 0
    starts = np.flatnonzero(np.diff(example.turn_ids)) + 1
    cut = int(starts[starts <= truncation.max_len].max(initial=0))
    lost = int(example.loss_mask[cut:].sum())
    if lost and truncation.overflow == "drop":
        return None, "dropped_too_long", targets
    if lost == targets:
        return None, "dropped_no_target", lost
    return Example(*(field[:cut] for field in example)), "trimmed" if lost else "trimmed_untrained", lost
