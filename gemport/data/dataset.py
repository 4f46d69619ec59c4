"""A dataset's records -> masked, fitted examples, as TRL's ``SFTTrainer`` trains them.

The orchestration over the pieces: records read and rendered per their format (`gemport.data.formats`),
the rendering checked against the tokenizer's own template (`gemport.data.template`), then tokenized and
fitted (`gemport.data.pipeline`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from gemport.errors import MaskError
from gemport.data import formats
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.pipeline import fit
from gemport.data.policies import MaskPolicy
from gemport.data.template import OnMismatch, check_template
from gemport.data.tokenize import Example, check_tokenizer
from gemport.data.truncation import Truncation, TruncationReport


def examples(source: Any, tokenizer: Any, chat_format: Gemma3 | Gemma4 | None, truncation: Truncation, *,
             policy: MaskPolicy | None = None, fmt: formats.Format | None = None, completion_only_loss: bool | None = None,
             text_field: str = "text", eos_token: str | None = None, check: OnMismatch | None = "warn",
             check_sample: int = 16, batch_size: int = 512,
             progress: bool = True) -> tuple[list[Example], TruncationReport]:
    """Masked, fitted examples from every record of ``source``, as TRL's ``SFTTrainer`` would train them.

    source: anything ``formats.read`` takes (a .jsonl/.json/.parquet path, a ``datasets.Dataset``, a Grain
        source, a list of dicts). tokenizer: a fast tokenizer (its ``eos_token`` is the default
        ``eos_token``). chat_format: ``Gemma3()`` or ``Gemma4(...)``, e.g. from
        ``gemport.data.template.chat_format(tokenizer)``; None for a tokenizer without a chat template (text and
        prompt/completion strings only, as TRL takes them). truncation: ``Truncation``.
    policy, fmt, completion_only_loss, text_field, eos_token: as ``formats.render`` takes them.
    check: "warn", "raise" or None: compare the rendering of the first ``check_sample``
        conversations with the tokenizer's own ``apply_chat_template`` (``check_template``); a
        tokenizer without a chat template is not checked.
    Returns (examples, report): the kept ``Example``s in input order and the ``TruncationReport``,
    which names records by their ``"id"`` field, else by their index in ``source``.
    """
    if chat_format is not None:
        check_tokenizer(tokenizer, chat_format)
    if eos_token is None:
        eos_token = getattr(tokenizer, "eos_token", None)
    records = formats.located(source)

    def render(index, where, record):
        # Every malformed record is named where the user finds it: file and line (or index), then the field.
        key = record.get("id", index) if isinstance(record, Mapping) else index
        try:
            return formats.render(record, chat_format, policy=policy, fmt=fmt,
                                  completion_only_loss=completion_only_loss, text_field=text_field,
                                  eos_token=eos_token, key=key)
        except MaskError as e:
            raise MaskError(f"{where}: {e}") from None
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a value of the wrong kind deeper down
            raise MaskError(f"{where}: malformed record ({type(e).__name__}: {e}); fields as TRL's SFT formats "
                            "have them: messages [{role, content}], prompt + completion, or text") from None

    if check and getattr(tokenizer, "chat_template", None):
        head = list(itertools.islice(records, check_sample))
        for index, (where, record) in enumerate(head):
            render(index, where, record)  # a malformed record fails here, named, not inside the tokenizer's template
        sample = [r for _, r in head if formats.conversational(r, fmt or formats.detect(r, text_field))]
        check_template(tokenizer, chat_format, sample, on_mismatch=check)
        records = itertools.chain(head, records)

    def rendered():
        for index, (where, record) in enumerate(records):
            yield render(index, where, record)

    total = len(source) if hasattr(source, "__len__") and not isinstance(source, (str, os.PathLike)) else None
    return fit(rendered(), tokenizer, truncation, batch_size=batch_size, progress=progress, total=total)


__all__ = ["examples"]
