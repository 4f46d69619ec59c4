"""The tokenizer's own chat template as the arbiter of gemport's rendering.

``chat_format(tokenizer)`` picks the chat format, and for Gemma 4 the template revision, that
renders like the tokenizer's template; ``check_template`` compares the two on a sample of real
conversations and names the first conversation and character where they part.
"""

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from gemport.errors import MaskError, TemplateMismatchError, TemplateMismatchWarning
from gemport.data.formats import conversation, for_record
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import REVISIONS, Gemma4, Thinking
from gemport._src.options import one_of

OnMismatch = Literal["warn", "raise"]
"""What ``check_template`` does on a mismatch: a ``TemplateMismatchWarning`` or a ``TemplateMismatchError``."""


_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": None, "b": "x"}}}
# Conversations on which the published Gemma 4 revisions disagree: reasoning without tool calls,
# assistant after assistant, tool turns and None values, whitespace content beside a tool response.
_PROBES = (
    [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning": "r"},
     {"role": "assistant", "content": "b"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
     {"role": "assistant", "content": " ", "tool_calls": [_CALL]},
     {"role": "tool", "tool_call_id": "c", "content": "t"}],
    [{"role": "user", "content": "u"}, {"role": "assistant", "tool_calls": [_CALL]},
     {"role": "tool", "tool_call_id": "c", "content": "t"}, {"role": "assistant", "content": "done"}],
)


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template (its ``"default"`` one when it has several); MaskError if none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise MaskError(f"tokenizer: {type(tokenizer).__name__} has no chat template to follow or check against")
    return template


def chat_format(tokenizer: Any, *, thinking: Thinking = "off", keep_reasoning: bool = False) -> Gemma3 | Gemma4:
    """``Gemma3()`` or ``Gemma4(...)`` rendering as ``tokenizer.apply_chat_template`` does.

    For Gemma 4, each published template revision renders a few probe conversations on which they
    disagree; the newest revision that agrees with the tokenizer's template on all of them is
    chosen. When none agrees on all, the closest is returned with a ``TemplateMismatchWarning``
    naming the probe: run ``check_template`` on your data before training on it. ``thinking`` and
    ``keep_reasoning`` are passed to ``Gemma4``.
    """
    template = template_text(tokenizer)
    if "<|turn>" in template:
        agreeing = {}
        for revision in REVISIONS:
            candidate = Gemma4(revision=revision)
            agreeing[revision] = [_first_difference(*_renderings(tokenizer, candidate, p, None)) for p in _PROBES]
        best = max(REVISIONS, key=lambda r: (agreeing[r].count(None), r))
        differing = [(k, at) for k, at in enumerate(agreeing[best]) if at is not None]
        if differing:
            k, at = differing[0]
            warnings.warn(
                f"tokenizer: its chat template renders like no published Gemma 4 revision; the closest, "
                f"revision {best}, differs on probe conversation {k} at character {at}. Check your data "
                "with gemport.data.template.check_template",
                TemplateMismatchWarning,
                stacklevel=2,
            )
        return Gemma4(thinking=thinking, keep_reasoning=keep_reasoning, revision=best)
    if "<start_of_turn>" in template:
        return Gemma3()
    raise MaskError("tokenizer: its chat template is neither Gemma 3's (<start_of_turn>) nor Gemma 4's (<|turn>)")


def check_template(tokenizer: Any, chat_format: Gemma3 | Gemma4, sample: Iterable[Any],
                   on_mismatch: OnMismatch = "warn") -> tuple[int, int] | None:
    """Compares ``chat_format``'s rendering with ``tokenizer.apply_chat_template`` on ``sample``.

    sample: conversations, each a message list or a conversational record ({"messages"} or
        {"prompt", "completion"} lists, optional "tools"), as ``gemport.data.formats`` reads them.
    on_mismatch: "warn" (a ``TemplateMismatchWarning``) or "raise" (``TemplateMismatchError``), for the
        first conversation that differs; the message names its index in ``sample``, the character
        offset and the text on both sides.
    Returns None when every conversation renders alike, else (index, offset) of the first difference.
    Gemma 4 options beyond the template (``keep_reasoning``, ``thinking="empty_thought"``) and whitespace-only
    reasoning, which gemport never renders, show up as differences by design.
    """
    one_of(on_mismatch, OnMismatch, "on_mismatch", MaskError)
    for index, item in enumerate(sample):
        messages, tools = conversation(item) if isinstance(item, Mapping) else (item, None)
        record_format = for_record(chat_format, item) if isinstance(item, Mapping) else chat_format
        expected, rendered = _renderings(tokenizer, record_format, messages, tools)
        at = _first_difference(expected, rendered)
        if at is None:
            continue
        message = (
            f"conversation {index}: gemport's {chat_format!r} renders differently from the tokenizer's chat "
            f"template from character {at}: template {expected[max(0, at - 40):at + 40]!r}, gemport "
            f"{rendered[max(0, at - 40):at + 40]!r}; pick the format with gemport.data.template.chat_format("
            "tokenizer) or fix the data"
        )
        if on_mismatch == "raise":
            raise TemplateMismatchError(message)
        warnings.warn(message, TemplateMismatchWarning, stacklevel=2)
        return index, at
    return None


def _renderings(tokenizer, chat_format, messages, tools):
    # (the template's text, gemport's text); an error on either side stands in for its text.
    try:
        expected = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, enable_thinking=getattr(chat_format, "enable_thinking", False)
        )
    except Exception as error:  # a template may raise anything (jinja's TemplateError, KeyError, ...)
        expected = f"<the template raised {type(error).__name__}: {error}>"
    try:
        rendered = "".join(s.text for s in chat_format.render(messages, tools))
    except MaskError as error:
        rendered = f"<gemport raised MaskError: {error}>"
    return expected, rendered


def _first_difference(expected, rendered):
    # The first character where the two texts differ, None if they are equal.
    if expected == rendered:
        return None
    n = min(len(expected), len(rendered))
    return next((k for k in range(n) if expected[k] != rendered[k]), n)
