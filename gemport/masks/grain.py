"""Mask building inside a Grain pipeline, and Grain's packed rows in gemport's layout.

Grain is imported here only, so ``gemport.masks`` itself does not need it.
"""

import grain.transforms
import numpy as np

from gemport.masks.formats import render
from gemport.masks.pipeline import fit_batch
from gemport.masks.tokenize import check_tokenizer
from gemport.masks.truncation import TruncationReport


class MaskTransform(grain.transforms.Map, grain.transforms.MapWithIndex):
    """Grain transform: a record of any SFT format to {"tokens": int32 [n], "loss_mask": bool [n]}.

    Records are those ``gemport.masks.formats`` reads ({"messages"}, {"prompt", "completion"},
    {"text"}), rendered as ``formats.render`` does with ``chat_format``, ``policy`` and the keyword
    options, and fitted with ``truncation``. Use it with ``.map_with_index(transform)`` (the report
    then names records by their "id", else their index) or ``.map(transform)`` (by "id" only).
    A map cannot drop, so a dropped example comes out with n = 0: follow with
    ``.filter(has_target)``. ``report`` counts the decisions taken in this process (each Grain
    worker process keeps its own copy). The output packs with Grain's packers
    (``length_struct={"tokens": L, "loss_mask": L}``); its first token is never a target, so no
    target crosses a packed boundary.
    """

    def __init__(self, tokenizer, chat_format, policy, truncation, *, fmt=None, completion_only_loss=None,
                 text_field="text", eos_token=None):
        check_tokenizer(tokenizer, chat_format)
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.truncation = truncation
        self.options = dict(
            policy=policy, fmt=fmt, completion_only_loss=completion_only_loss, text_field=text_field,
            eos_token=eos_token if eos_token is not None else getattr(tokenizer, "eos_token", None),
        )
        self.report = TruncationReport()

    def map(self, element):
        """{"tokens": int32 [n], "loss_mask": bool [n]} for one record; n = 0 if dropped."""
        return self._fit(element, element.get("id"))

    def map_with_index(self, index, element):
        """``map``, naming the record in ``report`` by its "id", else by ``index``."""
        return self._fit(element, element.get("id", index))

    def _fit(self, element, key):
        rendered = render(element, self.chat_format, key=key, **self.options)
        [(example, decision, lost)] = fit_batch([rendered], self.tokenizer, self.truncation)
        self.report.record(decision, lost, key)
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
