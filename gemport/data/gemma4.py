"""The Gemma 4 chat format: ``<|turn>system|user|model\\n ... <turn|>\\n`` with reasoning and tool calls.

Five revisions of Google's Gemma 4 chat template are in circulation; TRL ships them as
``gemma4.jinja`` (revision 1) and ``gemma4_v2.jinja`` ... ``gemma4_v5.jinja``. They render the same
conversation differently (reasoning, tool turns, turn ends), so ``Gemma4(revision=...)`` follows
one of them, and ``gemport.data.template.chat_format`` picks it from a tokenizer's template.
"""

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from gemport.errors import MaskError
from gemport.data.render import SYSTEM_ROLES, Segment, check_messages, check_plain, check_tools, text_parts
from gemport._src.options import one_of

_QUOTE = '<|"|>'
Revision = Literal[1, 2, 3, 4, 5]
"""Gemma 4 template revisions, numbered as TRL's files: 1 is ``gemma4.jinja``, n is ``gemma4_vn.jinja``."""
REVISIONS: tuple[Revision, ...] = typing.get_args(Revision)

Thinking = Literal["off", "on", "empty_thought"]
"""How ``Gemma4`` renders thinking: off, on (the template's ``enable_thinking``), or off with the empty
thought block the 26B/31B models open their answers with."""
# Keys of a JSON schema that the parameter formatter skips when it walks a schema as properties.
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Gemma4:
    """Renders conversations as Gemma 4's chat template does, for training.

    thinking: ``"on"`` opens with ``<|turn>system\\n<|think|>\\n`` (a system turn is rendered even
        without a system message), as the template does with ``enable_thinking``. ``"off"`` (the
        default) renders without. ``"empty_thought"`` is off, and opens every assistant turn that has
        no rendered reasoning with the empty ``<|channel>thought\\n<channel|>`` that the 26B/31B
        generation prompt adds; it is rendered as part of the header, so it is context and never a target.
    keep_reasoning: the template drops the ``reasoning`` of assistant messages before the last user
        message (what the model sees at inference). False keeps that behaviour; True renders the
        reasoning of every assistant message that has one, for data whose earlier traces are wanted.
    revision: which published template to follow (``REVISIONS``; 5, the newest, by default); how the
        revisions differ: docs/masks.md#chat-formats.

    Empty reasoning is never rendered; tool calls and their responses render inside the model turn, the
    first ``<|tool_response>`` being the assistant's ``end``. See docs/masks.md#chat-formats.
    """

    thinking: Thinking = "off"
    keep_reasoning: bool = False
    revision: Revision = 5

    control_tokens = (
        "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
        "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", _QUOTE,
        "<|tool>", "<tool|>",
    )

    def __post_init__(self) -> None:
        one_of(self.thinking, Thinking, "Gemma4.thinking", MaskError)
        one_of(self.revision, Revision, "Gemma4.revision", MaskError)

    @property
    def enable_thinking(self) -> bool:
        """The chat template's ``enable_thinking`` for this rendering."""
        return self.thinking == "on"

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> tuple[Segment, ...]:
        """Returns the ``Segment``s of ``messages``; the input is not modified.

        messages: list of {"role", "content"} with optional "reasoning" (or "reasoning_content") and
            "tool_calls" on assistant messages, and {"role": "tool", "content", optional "name" /
            "tool_call_id"} after an assistant message with tool calls. A leading ``system`` or
            ``developer`` message is the system turn. ``content`` is a string, a list of text parts
            ({"type": "text", "text": str}) or None (an empty turn).
        tools: function declarations ({"type": "function", "function": {"name", "description",
            "parameters": JSON schema}}), written into the system turn as ``<|tool>declaration:...<tool|>``.
        add_generation_prompt: end with the cue that opens the model's next turn (context, never a
            target), as a prompt is rendered before its completion.
        """
        check_messages(messages)
        tools = check_tools(tools)
        out = _Segments()
        out.add("<bos>", "", "bos")
        body, offset = list(messages), 0
        system = bool(body) and body[0]["role"] in SYSTEM_ROLES
        if self.enable_thinking or tools or system:
            out.turn += 1
            think = ("<|think|>" if self.revision == 2 else "<|think|>\n") if self.enable_thinking else ""
            out.add("<|turn>system\n" + think, "system", "header")
            if system:
                out.add(self._system_text(body[0].get("content")), "system", "content")
                body, offset = body[1:], 1
            for k, tool in enumerate(tools):
                out.add(f"<|tool>{self._declaration(tool['function'], f'tools[{k}]')}<tool|>", "system", "content")
            out.add("<turn|>\n", "system", "end")
        last = (self._render_v2 if self.revision == 2 else self._render)(body, offset, out)
        if add_generation_prompt:
            self._generation_prompt(last, out)
        return tuple(out.segments)

    def _render(self, body, offset, out):
        # Returns what the last message ended on: "tool_call", "tool_response" or None.
        last_user = max((i for i, m in enumerate(body) if m["role"] == "user"), default=-1)
        previous, last = None, None
        i = 0
        while i < len(body):
            message, where = body[i], f"messages[{i + offset}]"
            role = self._role(message, where, ("user", "assistant"))
            opens = not (role == "assistant" and previous == "assistant")
            if opens:
                out.turn += 1
                out.add("<|turn>" + ("model" if role == "assistant" else "user") + "\n", role, "header")
            calls = self._calls(message, where)
            reasoning = self._reasoning(message, where)
            gate = i > last_user and (self.revision == 5 or bool(calls))
            if reasoning.strip() and (self.keep_reasoning or gate):
                out.add(f"<|channel>thought\n{reasoning}\n<channel|>", role, "reasoning")
            elif role == "assistant" and opens and self.thinking == "empty_thought":
                out.add("<|channel>thought\n<channel|>", role, "header")
            names = {}
            for k, call in enumerate(calls):
                name, arguments = self._call(call, f"{where}.tool_calls[{k}]")
                names[call.get("id")] = name
                out.add(f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>", role, "tool_call")
            j = i + 1
            legacy = message.get("tool_responses")
            if legacy:
                self._legacy_responses(legacy, where, out)
            elif calls:
                j = self._responses(body, i + 1, names, offset, out)
            content = self._content(message, where)
            out.add(content, role, "content")
            responded = bool(legacy) or j > i + 1
            following = body[j]["role"] if j < len(body) else None
            # Revision 3 asks whether the message has content before rendering it; the others, after.
            has_content = bool(message.get("content")) if self.revision == 3 else bool(content)
            if calls and not responded:
                out.add("<|tool_response>", role, "end")
            elif self.revision == 5 and role == "assistant" and following == "assistant":
                pass  # the next assistant message continues this model turn
            elif not (responded and not has_content and (self.revision != 5 or following is None)):
                out.add("<turn|>\n", role, "end")
            last = "tool_response" if responded else "tool_call" if calls else None
            previous, i = role, j
        return last

    def _render_v2(self, body, offset, out):
        # Revision 2: every message is its own turn, tool messages included; reasoning is never shown.
        previous, last = None, None
        for i, message in enumerate(body):
            where = f"messages[{i + offset}]"
            role = self._role(message, where, ("user", "assistant", "tool"))
            if role == "tool" and previous not in ("assistant_calls", "tool"):
                raise _misplaced(where, role)
            out.turn += 1
            out.add("<|turn>" + ("model" if role == "assistant" else role) + "\n", role, "header")
            calls = self._calls(message, where)
            self._reasoning(message, where)
            for k, call in enumerate(calls):
                name, arguments = self._call(call, f"{where}.tool_calls[{k}]")
                out.add(f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>", role, "tool_call")
            legacy = message.get("tool_responses")
            if legacy:
                self._legacy_responses(legacy, where, out)
            out.add(self._content(message, where), role, "content")
            if not (legacy and not message.get("content")):
                out.add("<turn|>\n", role, "end")
            last = "tool_response" if legacy else "tool_call" if calls else None
            previous = "assistant_calls" if calls else role
        return last

    def _generation_prompt(self, last, out):
        # After tool output the model's turn is still open; revision 2 does not know that after a call.
        waiting = ("tool_response",) if self.revision == 2 else ("tool_response", "tool_call")
        if last not in waiting:
            out.turn += 1
            out.add("<|turn>model\n", "assistant", "header")
            if self.thinking == "empty_thought":
                out.add("<|channel>thought\n<channel|>", "assistant", "header")
        elif last == "tool_response" and self.enable_thinking and self.revision == 5:
            out.add("<|channel>thought\n", "assistant", "header")

    def _role(self, message, where, allowed):
        if message["role"] not in allowed:
            raise _misplaced(where, message["role"])
        return message["role"]

    def _calls(self, message, where):
        calls = message.get("tool_calls") or ()
        if calls and message["role"] != "assistant":
            raise MaskError(f"{where}: only assistant messages carry tool_calls")
        return calls

    def _reasoning(self, message, where):
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning and message["role"] != "assistant":
            raise MaskError(f"{where}: only assistant messages carry reasoning")
        return self._plain(reasoning or "", f"{where}.reasoning")

    def _content(self, message, where):
        # Strings and each text part are trimmed and joined without a separator, as the template does.
        content = message.get("content")
        if content is None:
            return ""
        return "".join(t.strip() for t in text_parts(content, f"{where}.content", self.control_tokens))

    def _system_text(self, content):
        if content is None:
            return ""
        if isinstance(content, str):
            return self._plain(content, "messages[0].content").strip()
        if self.revision in (2, 3):
            raise MaskError(
                f"messages[0].content: Gemma 4 template revision {self.revision} renders a list of parts as "
                "its Python repr; pass the system message as a string"
            )
        # The template follows every system text part with a space, the last one included.
        return "".join(t.strip() + " " for t in text_parts(content, "messages[0].content", self.control_tokens))

    def _responses(self, body, j, names, offset, out):
        # The tool messages from body[j] on, rendered inside the model turn; returns the index after them.
        first = j
        while j < len(body) and body[j]["role"] == "tool":
            tool, where = body[j], f"messages[{j + offset}]"
            name = names.get(tool.get("tool_call_id")) or tool.get("name") or "unknown"
            name = self._plain(name, f"{where}.name")
            # Only the first opener is the model's output: it stops there and the tool answers.
            out.add("<|tool_response>", *(("assistant", "end") if j == first else ("tool", "content")))
            content = tool.get("content")
            if content is not None:
                content = "".join(text_parts(content, f"{where}.content", self.control_tokens))
            out.add(f"response:{name}{{value:{self._value(content, where)}}}<tool_response|>", "tool", "content")
            j += 1
        return j

    def _legacy_responses(self, responses, where, out):
        # Gemma's own format: {"name", "response"} entries on the assistant message itself.
        for k, response in enumerate(responses):
            at = f"{where}.tool_responses[{k}]"
            if not isinstance(response, Mapping):
                raise MaskError(f"{at}: expected {{'name': str, 'response': ...}}")
            name = self._plain(response.get("name") or "unknown", f"{at}.name")
            out.add("<|tool_response>", *(("assistant", "end") if k == 0 else ("tool", "content")))
            value = response.get("response")
            body = self._fields(value, at) if isinstance(value, Mapping) else "value:" + self._value(value, at)
            out.add(f"response:{name}{{{body}}}<tool_response|>", "tool", "content")

    def _plain(self, text, where):
        return check_plain(text, where, self.control_tokens)

    def _call(self, call, where):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise MaskError(f"{where}: expected {{'function': {{'name', 'arguments'}}}}")
        name = self._plain(function.get("name"), f"{where}.function.name")
        arguments = function.get("arguments")
        if arguments is None:
            return name, ""
        if not isinstance(arguments, Mapping):
            raise MaskError(f"{where}.function.arguments: expected a dict (parse JSON strings first)")
        return name, self._fields(arguments, where)

    def _fields(self, mapping, where, quote_keys=False):
        # Keys sorted case-insensitively, as Jinja's dictsort does in the template.
        keys = sorted((self._plain(key, where) for key in mapping), key=str.lower)
        q = _QUOTE if quote_keys else ""
        return ",".join(f"{q}{key}{q}:{self._value(mapping[key], where, quote_keys)}" for key in keys)

    def _value(self, value, where, quote_keys=False):
        # Gemma 4 writes tool values in its own notation: strings between <|"|> quotes, bare keys.
        if value is None:
            return "null" if self.revision == 5 else "None"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return _QUOTE + self._plain(value, where) + _QUOTE
        if isinstance(value, Mapping):
            return "{" + self._fields(value, where, quote_keys) + "}"
        if isinstance(value, Sequence):
            return "[" + ",".join(self._value(item, where, quote_keys) for item in value) + "]"
        return str(value)

    def _text(self, mapping, key, where):
        # What Jinja prints for mapping[key]: nothing when the key is missing, str() of anything else.
        value = mapping.get(key, _MISSING) if isinstance(mapping, Mapping) else _MISSING
        if value is _MISSING:
            return ""
        return self._plain(value, f"{where}.{key}") if isinstance(value, str) else str(value)

    def _declaration(self, function, where):
        """``declaration:name{description:...,parameters:{...}}`` for one tool, as the template writes it."""
        where = f"{where}.function"
        text = f"declaration:{self._text(function, 'name', where)}{{description:{_QUOTE}"
        text += self._text(function, "description", where) + _QUOTE
        params, at = function.get("parameters"), f"{where}.parameters"
        if params and not isinstance(params, Mapping):
            raise MaskError(f"{at}: expected a JSON schema (a dict), got {type(params).__name__}")
        if params:
            text += ",parameters:{"
            if params.get("properties"):
                text += "properties:{" + self._parameters(params["properties"], False, at) + "},"
            if params.get("required"):
                text += "required:[" + self._quoted_list(params["required"], at) + "],"
            if params.get("type"):
                text += f"type:{_QUOTE}{self._text(params, 'type', at).upper()}{_QUOTE}}}"
        if "response" in function:
            response, at = function["response"], f"{where}.response"
            if not isinstance(response, Mapping):
                raise MaskError(f"{at}: expected a dict, got {type(response).__name__}")
            text += ",response:{"
            if response.get("description"):
                text += f"description:{_QUOTE}{self._text(response, 'description', at)}{_QUOTE},"
            if self._text(response, "type", at).upper() == "OBJECT":
                text += f"type:{_QUOTE}OBJECT{_QUOTE}}}"
        return (text + "}").strip()

    def _quoted_list(self, items, where):
        return ",".join(_QUOTE + (self._plain(i, where) if isinstance(i, str) else str(i)) + _QUOTE for i in items)

    def _parameters(self, properties, filter_keys, where):
        # One JSON-schema property per key, in the order and spelling of each revision's template.
        entries = []
        for key in sorted(properties, key=str.lower):
            value, at = properties[key], f"{where}.{key}"
            if (filter_keys or self.revision in (2, 3)) and key in _STANDARD_KEYS:
                continue
            if not isinstance(value, Mapping):
                raise MaskError(f"{at}: expected a JSON schema (a dict), got {type(value).__name__}")
            parts, comma = [], _Comma()
            if value.get("description"):
                parts.append(f"description:{_QUOTE}{self._text(value, 'description', at)}{_QUOTE}")
                comma.needed = True
            kind = self._text(value, "type", at).upper()
            items = value.get("items")
            if self.revision == 2:
                if value.get("nullable"):
                    parts.append(comma() + "nullable:true")
                if kind == "STRING" and value.get("enum"):
                    parts.append(comma() + "enum:" + self._value(value["enum"], at, quote_keys=True))
                elif kind == "OBJECT":
                    inner = value["properties"] if isinstance(value.get("properties"), Mapping) else value
                    parts.append(",properties:{" + self._parameters(inner, False, at) + "}")
                    if value.get("required"):
                        parts.append(",required:[" + self._quoted_list(value["required"], at) + "]")
                elif kind == "ARRAY" and isinstance(items, Mapping) and items:
                    parts.append(",items:{" + self._items(items, at) + "}")
            else:
                if kind == "STRING" and value.get("enum"):
                    parts.append(comma() + "enum:" + self._value(value["enum"], at, quote_keys=True))
                elif kind == "ARRAY" and isinstance(items, Mapping) and items:
                    parts.append(comma() + "items:{" + self._items(items, at) + "}")
                if value.get("nullable"):
                    parts.append(comma() + "nullable:true")
                if kind == "OBJECT":
                    if isinstance(value.get("properties"), Mapping):
                        parts.append(comma() + "properties:{" + self._parameters(value["properties"], False, at) + "}")
                    else:
                        parts.append(comma() + "properties:{" + self._parameters(value, True, at) + "}")
                    if value.get("required"):
                        parts.append(comma() + "required:[" + self._quoted_list(value["required"], at) + "]")
            parts.append(f"{comma()}type:{_QUOTE}{kind}{_QUOTE}}}")
            entries.append(f"{self._plain(key, at)}:{{" + "".join(parts))
        return ",".join(entries)

    def _items(self, items, where):
        entries = []
        for key in sorted(items, key=str.lower):
            value, at = items[key], f"{where}.items.{key}"
            if value is None:
                continue
            if key == "properties":
                inner = self._parameters(value, False, at) if isinstance(value, Mapping) else ""
                entries.append("properties:{" + inner + "}")
            elif key == "required":
                entries.append("required:[" + self._quoted_list(value, at) + "]")
            elif key == "type":
                upper = value.upper() if isinstance(value, str) else [str(v).upper() for v in value]
                entries.append("type:" + self._value(upper, at, quote_keys=True))
            else:
                entries.append(f"{self._plain(key, at)}:{self._value(value, at, quote_keys=True)}")
        return ",".join(entries)


def _misplaced(where, role):
    return MaskError(
        f"{where}: role {role!r} here; a system message must come first (role system or developer) and a tool "
        "message must follow an assistant message with tool_calls (or another tool message)"
    )


class _Comma:
    """The template's ``add_comma`` flag: a separator before every field but the first."""

    def __init__(self):
        self.needed = False

    def __call__(self):
        separator = "," if self.needed else ""
        self.needed = True
        return separator


class _Segments:
    """Collects non-empty segments, stamping each with the current turn index."""

    def __init__(self):
        self.segments = []
        self.turn = -1

    def add(self, text, role, part):
        if text:
            self.segments.append(Segment(text, role, part, self.turn))
