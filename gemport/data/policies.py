"""Which rendered segments are trained: the loss-mask policy as data."""

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from gemport.errors import MaskError
from gemport.data.render import Segment
from gemport._src.options import one_of

Train = Literal["assistant", "all", "last_assistant", "all_tokens"]
"""What ``MaskPolicy.train`` trains (see ``MaskPolicy``)."""

_TRAINED_PARTS = ("content", "tool_call", "end")


@dataclasses.dataclass(frozen=True)
class MaskPolicy:
    """A named loss-mask policy.

    train: ``"assistant"`` trains every assistant turn; ``"all"`` trains every user and assistant
        turn; ``"last_assistant"`` trains only the last turn that has assistant output;
        ``"all_tokens"`` trains every token, headers and system text included (TRL's SFT loss without
        ``assistant_only_loss``).
    reasoning: also train the ``<|channel>thought ... <channel|>`` blocks of trained turns
        (default False: reasoning is context, not a target).

    Except under ``"all_tokens"``, a turn is trained on its content, tool calls and end-of-turn text,
    never on its header; ``<bos>``, system and tool segments are never trained.
    """

    train: Train = "assistant"
    reasoning: bool = False

    def __post_init__(self) -> None:
        one_of(self.train, Train, "MaskPolicy.train", MaskError)

    def select(self, segments: Sequence[Segment]) -> np.ndarray:
        """Returns bool [len(segments)]: whether each ``Segment`` is trained."""
        if self.train == "all_tokens":
            return np.ones(len(segments), dtype=bool)
        roles = ("user", "assistant") if self.train == "all" else ("assistant",)
        parts = _TRAINED_PARTS + (("reasoning",) if self.reasoning else ())
        trained = np.array([s.role in roles and s.part in parts for s in segments], dtype=bool)
        if self.train == "last_assistant":
            last = max((s.turn for s in segments if s.role == "assistant"), default=None)
            trained &= np.array([s.turn == last for s in segments], dtype=bool)
        return trained
