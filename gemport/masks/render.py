"""Rendered conversations as labelled text segments.

A renderer turns messages into ``Segment``s whose texts, concatenated, are exactly the chat-format
string the tokenizer sees. Each segment carries the role and part it came from and the index of
the turn it belongs to, so masks are decided on text before any tokenizer merges characters.
"""

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from gemport.errors import MaskError

ROLES = ("", "system", "user", "assistant", "tool")
"""Role names, indexed by ``Example.role_ids``; ``""`` is the ``<bos>`` token, which has no role."""

PARTS = ("bos", "header", "content", "reasoning", "tool_call", "end")
"""Part names, indexed by ``Example.part_ids``.

``header`` is the role cue that opens a turn (the model never generates it), ``end`` is the
end-of-turn text (``<end_of_turn>\\n``, ``<turn|>\\n``, or the ``<|tool_response>`` a model stops on
after a tool call), ``reasoning`` is a whole ``<|channel>thought\\n...<channel|>`` block.
"""


class Segment(NamedTuple):
    """A run of rendered text with one role, one part and one turn index (-1 for ``<bos>``)."""

    text: str
    role: str
    part: str
    turn: int


def check_plain(text, where, control_tokens):
    """Raises MaskError if ``text`` (user data) is not a string or holds a control token.

    A control token inside data would be tokenized as a real turn or channel marker and silently
    change the structure the mask is computed from.
    """
    if not isinstance(text, str):
        raise MaskError(f"{where}: expected a string, got {type(text).__name__}")
    for token in control_tokens:
        if token in text:
            raise MaskError(f"{where}: contains the control token {token!r}; data must be plain text")
    return text


def check_messages(messages):
    """Raises MaskError unless ``messages`` is a sequence of mappings that each have a string role."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise MaskError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise MaskError(f"messages[{i}]: expected a dict with a string 'role'")
