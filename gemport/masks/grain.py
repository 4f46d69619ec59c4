"""Mask building inside a Grain pipeline, and Grain's packed rows in gemport's layout.

Grain is imported here only, so ``gemport.masks`` itself does not need it.
"""

import grain.transforms
import numpy as np

from gemport.masks.pipeline import prepare
from gemport.masks.tokenize import check_tokenizer
from gemport.masks.truncation import TruncationReport


class MaskTransform(grain.transforms.Map):
    """Grain map transform: a record {"messages": [...]} to {"tokens": int32 [n], "loss_mask": bool [n]}.

    A ``grain.transforms.Map`` (Grain's ``MapTransform`` in earlier releases).
    Renders with ``chat_format``, masks with ``policy`` and fits with ``truncation``, as ``build``
    does. A map cannot drop, so a dropped example comes out with n = 0: follow with
    ``.filter(has_target)``. ``report`` counts the decisions taken in this process (each Grain
    worker process keeps its own copy). The output packs with Grain's packers
    (``length_struct={"tokens": L, "loss_mask": L}``); its first token is never a target, so no
    target crosses a packed boundary.
    """

    def __init__(self, tokenizer, chat_format, policy, truncation):
        check_tokenizer(tokenizer, chat_format)
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.policy = policy
        self.truncation = truncation
        self.report = TruncationReport()

    def map(self, element):
        """{"tokens": int32 [n], "loss_mask": bool [n]} for ``element["messages"]``; n = 0 if dropped."""
        example, decision, lost = prepare(
            element["messages"], self.tokenizer, self.chat_format, self.policy, self.truncation
        )
        self.report.record(decision, lost)
        if example is None:
            return {"tokens": np.zeros(0, np.int32), "loss_mask": np.zeros(0, bool)}
        return {"tokens": example.tokens, "loss_mask": example.loss_mask}


def has_target(record):
    """True when ``record["loss_mask"]`` (bool [n]) trains at least one token."""
    return bool(np.any(record["loss_mask"]))


def from_grain(record):
    """Renames a row packed by Grain (``tokens``, ``loss_mask`` and their ``_segment_ids`` /
    ``_positions``) to ``pack``'s keys: "tokens", "loss_mask", "segment_ids", "positions", arrays of
    the record's shape ([T] or [B, T])."""
    return {
        "tokens": record["tokens"],
        "loss_mask": record["loss_mask"],
        "segment_ids": record["tokens_segment_ids"],
        "positions": record["tokens_positions"],
    }
