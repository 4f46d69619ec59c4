"""Rendered conversations as labelled text segments.

A renderer turns messages into ``Segment``s whose texts, concatenated, are exactly the chat-format
string the tokenizer sees. Each segment carries the role and part it came from and the index of
the turn it belongs to, so masks are decided on text before any tokenizer merges characters.
"""

import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from gemport.errors import MaskError

Role = Literal["", "system", "user", "assistant", "tool"]
"""Who a segment belongs to; ``""`` is the ``<bos>`` token, which has no role."""
ROLES: tuple[Role, ...] = typing.get_args(Role)
"""Role names, indexed by ``Example.role_ids``."""

Part = Literal["bos", "header", "content", "reasoning", "tool_call", "end"]
"""What a segment is within its turn (see ``PARTS``)."""
PARTS: tuple[Part, ...] = typing.get_args(Part)
"""Part names, indexed by ``Example.part_ids``.

``header`` is the role cue that opens a turn (the model never generates it), ``end`` is the
end-of-turn text (``<end_of_turn>\\n``, ``<turn|>\\n``, or the ``<|tool_response>`` a model stops on
after a tool call), ``reasoning`` is a whole ``<|channel>thought\\n...<channel|>`` block.
"""

SYSTEM_ROLES = ("system", "developer")
"""Roles rendered as the system turn: ``developer`` is the OpenAI-style name chat templates accept for it."""

_MEDIA_PARTS = ("image", "image_url", "audio", "input_audio", "video")


class Segment(NamedTuple):
    """A run of rendered text with one role, one part and one turn index (-1 for ``<bos>``)."""

    text: str
    role: Role
    part: Part
    turn: int


def check_plain(text: Any, where: str, control_tokens: Sequence[str]) -> str:
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


def text_parts(content: Any, where: str, control_tokens: Sequence[str]) -> list[str]:
    """The texts of ``content``, a string (one part) or a list of ``{"type": "text", "text": str}`` parts.

    Raises MaskError naming the part for an image, audio or video part (gemport renders text only:
    a processor must expand those into the model's soft tokens) or for any other part type.
    """
    if isinstance(content, str):
        return [check_plain(content, where, control_tokens)]
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise MaskError(f"{where}: expected a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _MEDIA_PARTS:
            raise MaskError(
                f"{where}[{k}]: a {kind!r} part; gemport.data renders text only, so drop media parts or "
                "prepare multimodal data with the model's processor"
            )
        if kind != "text":
            raise MaskError(f"{where}[{k}]: expected {{'type': 'text', 'text': str}}, got {part!r}")
        texts.append(check_plain(part.get("text"), f"{where}[{k}].text", control_tokens))
    return texts


def check_messages(messages: Any) -> None:
    """Raises MaskError unless ``messages`` is a sequence of mappings that each have a string role."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise MaskError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise MaskError(f"messages[{i}]: expected a dict with a string 'role'")


def check_tools(tools: Any) -> tuple[Mapping[str, Any], ...]:
    """Returns ``tools`` as a tuple (None and [] give ()); raises MaskError unless each is a function
    declaration ``{"type": "function", "function": {"name": str, ...}}``."""
    if not tools:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise MaskError(f"tools: expected a list of function declarations, got {type(tools).__name__}")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise MaskError(f"tools[{k}]: expected {{'type': 'function', 'function': {{'name': str, ...}}}}")
    return tuple(tools)
