"""A dataset's records -> masked, fitted examples, as TRL's ``SFTTrainer`` trains them.

The orchestration over the pieces: records read and rendered per their format (`gemport.data.formats`),
the rendering checked against the tokenizer's own template (`gemport.data.template`), then tokenized and
fitted (`gemport.data.pipeline`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from gemport.errors import MaskError
from gemport.data import formats
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.pipeline import Rendered, fit
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
    options = Options(chat_format, policy=policy, fmt=fmt, completion_only_loss=completion_only_loss,
                      text_field=text_field, eos_token=eos_token if eos_token is not None
                      else getattr(tokenizer, "eos_token", None))
    records = formats.located(source)
    head = check_source(records, tokenizer, options, check=check, check_sample=check_sample)
    total = len(source) if hasattr(source, "__len__") and not isinstance(source, (str, os.PathLike)) else None
    return fitted(itertools.chain(head, records), tokenizer, truncation, options, batch_size=batch_size,
                  progress=progress, total=total)


@dataclasses.dataclass(frozen=True)
class Options:
    """How records render: ``formats.render``'s arguments (``eos_token`` resolved: the tokenizer's by default)."""

    chat_format: Gemma3 | Gemma4 | None
    policy: MaskPolicy | None = None
    fmt: formats.Format | None = None
    completion_only_loss: bool | None = None
    text_field: str = "text"
    eos_token: str | None = None

    def render(self, index: int, where: str, record: Any) -> Rendered:
        """``formats.render`` of one record, named in the report by its ``"id"``, else ``index``; a malformed
        record raises MaskError naming ``where`` (its file and line, or its index) and the field."""
        key = record.get("id", index) if isinstance(record, Mapping) else index
        try:
            return formats.render(record, self.chat_format, policy=self.policy, fmt=self.fmt,
                                  completion_only_loss=self.completion_only_loss, text_field=self.text_field,
                                  eos_token=self.eos_token, key=key)
        except MaskError as e:
            raise MaskError(f"{where}: {e}") from None
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a value of the wrong kind deeper down
            raise MaskError(f"{where}: malformed record ({type(e).__name__}: {e}); fields as TRL's SFT formats "
                            "have them: messages [{role, content}], prompt + completion, or text") from None


def check_source(records: Iterator[tuple[str, Any]], tokenizer: Any, options: Options, *,
                 check: OnMismatch | None = "warn", check_sample: int = 16) -> list[tuple[str, Any]]:
    """The checks before anything is tokenized: the tokenizer against ``options.chat_format``
    (``check_tokenizer``) and, with ``check``, the first ``check_sample`` records rendered (a malformed one fails
    here, named, not inside the tokenizer's template) and their conversations compared with the tokenizer's
    ``apply_chat_template`` (``check_template``).

    records: ``formats.located``'s (where, record) pairs; the head taken from it is returned, to be chained
    before the rest.
    """
    if options.chat_format is not None:
        check_tokenizer(tokenizer, options.chat_format)
    if not (check and getattr(tokenizer, "chat_template", None)):
        return []
    head = list(itertools.islice(records, check_sample))
    for index, (where, record) in enumerate(head):
        options.render(index, where, record)
    sample = [r for _, r in head
              if formats.conversational(r, options.fmt or formats.detect(r, options.text_field))]
    check_template(tokenizer, options.chat_format, sample, on_mismatch=check)
    return head


def fitted(records: Iterable[tuple[str, Any]], tokenizer: Any, truncation: Truncation, options: Options, *,
           first_index: int = 0, batch_size: int = 512, progress: bool = True,
           total: int | None = None) -> tuple[list[Example], TruncationReport]:
    """Rendered (``options``), tokenized and fitted examples of ``records`` (``formats.located``'s (where,
    record) pairs, the first of them record ``first_index`` of the dataset), unchecked (``check_source``).

    Returns (examples, report) as ``examples`` does.
    """
    rendered = (options.render(index, where, record)
                for index, (where, record) in enumerate(records, first_index))
    return fit(rendered, tokenizer, truncation, batch_size=batch_size, progress=progress, total=total)


__all__ = ["Options", "check_source", "examples", "fitted"]
