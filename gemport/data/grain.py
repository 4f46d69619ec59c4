"""Mask building inside a Grain pipeline, and Grain's packed rows in gemport's layout.

Grain is imported here only, so ``gemport.data`` itself does not need it.
"""

from collections.abc import Hashable, Mapping
from typing import Any

import grain.transforms
import numpy as np

from gemport.data.formats import Format, render
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.packing import Rows
from gemport.data.policies import MaskPolicy
from gemport.data.pipeline import fit_batch
from gemport.data.tokenize import check_tokenizer
from gemport.data.truncation import Truncation, TruncationReport


class MaskTransform(grain.transforms.Map, grain.transforms.MapWithIndex):
    """Grain transform: a record of any SFT format to {"tokens": int32 [n], "loss_mask": bool [n]}.

    Records are those ``gemport.data.formats`` reads ({"messages"}, {"prompt", "completion"},
    {"text"}), rendered as ``formats.render`` does with ``chat_format``, ``policy`` and the keyword
    options, and fitted with ``truncation``. Use it with ``.map_with_index(transform)`` (the report
    then names records by their "id", else their index) or ``.map(transform)`` (by "id" only).
    A map cannot drop, so a dropped example comes out with n = 0: follow with
    ``.filter(has_target)``. ``report`` counts the decisions taken in this process (each Grain
    worker process keeps its own copy). The output packs with Grain's packers
    (``length_struct={"tokens": L, "loss_mask": L}``); its first token is never a target, so no
    target crosses a packed boundary.
    """

    def __init__(self, tokenizer: Any, chat_format: Gemma3 | Gemma4, policy: MaskPolicy | None,
                 truncation: Truncation, *, fmt: Format | None = None, completion_only_loss: bool | None = None,
                 text_field: str = "text", eos_token: str | None = None) -> None:
        check_tokenizer(tokenizer, chat_format)
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.truncation = truncation
        self.options = dict(
            policy=policy, fmt=fmt, completion_only_loss=completion_only_loss, text_field=text_field,
            eos_token=eos_token if eos_token is not None else getattr(tokenizer, "eos_token", None),
        )
        self.report = TruncationReport()

    def map(self, element: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """{"tokens": int32 [n], "loss_mask": bool [n]} for one record; n = 0 if dropped."""
        return self._fit(element, element.get("id"))

    def map_with_index(self, index: int, element: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``map``, naming the record in ``report`` by its "id", else by ``index``."""
        return self._fit(element, element.get("id", index))

    def _fit(self, element: Mapping[str, Any], key: Hashable) -> dict[str, np.ndarray]:
        rendered = render(element, self.chat_format, key=key, **self.options)
        [(example, decision, lost)] = fit_batch([rendered], self.tokenizer, self.truncation)
        self.report.record(decision, lost, key)
        if example is None:
            return {"tokens": np.zeros(0, np.int32), "loss_mask": np.zeros(0, bool)}
        return {"tokens": example.tokens, "loss_mask": example.loss_mask}


def has_target(record: Mapping[str, Any]) -> bool:
    """True when ``record["loss_mask"]`` (bool [n]) trains at least one token."""
    return bool(np.any(record["loss_mask"]))


def from_grain(record: Mapping[str, np.ndarray]) -> Rows:
    """Renames a row packed by Grain (``tokens``, ``loss_mask`` and their ``_segment_ids`` /
    ``_positions``) to ``pack``'s ``Rows``, arrays of the record's shape ([T] or [B, T])."""
    return Rows(tokens=record["tokens"], loss_mask=record["loss_mask"], segment_ids=record["tokens_segment_ids"],
                positions=record["tokens_positions"])
