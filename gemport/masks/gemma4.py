"""The Gemma 4 chat format: ``<|turn>system|user|model\\n ... <turn|>\\n`` with reasoning and tool calls."""

import dataclasses
from collections.abc import Mapping, Sequence

from gemport.errors import MaskError
from gemport.masks.render import Segment, check_messages, check_plain

_QUOTE = '<|"|>'


@dataclasses.dataclass(frozen=True)
class Gemma4:
    """Renders conversations as Gemma 4's chat template does, for training.

    thinking: open with ``<|turn>system\\n<|think|>\\n`` (a system turn is rendered even without a
        system message), as the template does with ``enable_thinking``.
    keep_reasoning: the template drops the ``reasoning`` of assistant messages before the last user
        message (what the model sees at inference). False keeps that behaviour; True renders the
        reasoning of every assistant message that has one, for data whose earlier traces are wanted.
    empty_thought: with thinking off, open every assistant turn that has no rendered reasoning with
        the empty ``<|channel>thought\\n<channel|>`` that the 26B/31B generation prompt adds. It is
        rendered as part of the header, so it is context and never a target.

    Reasoning that is empty or whitespace is never rendered, so an empty thinking block is never
    trained. An assistant message's ``tool_calls`` ({"function": {"name", "arguments": dict}}) are
    rendered as ``<|tool_call>call:name{...}<tool_call|>``; the ``tool`` messages that follow it are
    rendered inside the same model turn as ``<|tool_response>response:name{...}<tool_response|>``.
    The first ``<|tool_response>`` after the calls is where the model stops to wait for the tool, so
    it is the assistant's ``end``; the response body is role ``tool``. A following assistant message
    continues the same model turn, as in the template.
    """

    thinking: bool = False
    keep_reasoning: bool = False
    empty_thought: bool = False

    control_tokens = (
        "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
        "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", _QUOTE,
    )

    def render(self, messages):
        """Returns the ``Segment``s of ``messages`` (list of {"role", "content", optional "reasoning",
        "tool_calls"}, and {"role": "tool", "content", optional "name"/"tool_call_id"}); the input is
        not modified."""
        check_messages(messages)
        out = _Segments()
        out.add("<bos>", "", "bos")
        body = list(messages)
        offset = 0
        if self.thinking or (body and body[0]["role"] == "system"):
            out.turn += 1
            out.add("<|turn>system\n" + ("<|think|>\n" if self.thinking else ""), "system", "header")
            if body and body[0]["role"] == "system":
                out.add(self._plain(body[0].get("content"), "messages[0].content").strip(), "system", "content")
                body, offset = body[1:], 1
            out.add("<turn|>\n", "system", "end")
        last_user = max((i for i, m in enumerate(body) if m["role"] == "user"), default=-1)
        previous = None
        i = 0
        while i < len(body):
            message, where = body[i], f"messages[{i + offset}]"
            role = message["role"]
            if role not in ("user", "assistant"):
                raise MaskError(
                    f"{where}: role {role!r} here; a system message must come first and a tool message "
                    "must follow an assistant message with tool_calls (or another tool message)"
                )
            opens = not (role == "assistant" and previous == "assistant")
            if opens:
                out.turn += 1
                out.add("<|turn>" + ("model" if role == "assistant" else "user") + "\n", role, "header")
            reasoning = message.get("reasoning") or message.get("reasoning_content")
            if reasoning and role != "assistant":
                raise MaskError(f"{where}: only assistant messages carry reasoning")
            reasoning = self._plain(reasoning or "", f"{where}.reasoning")
            if reasoning.strip() and (self.keep_reasoning or i > last_user):
                out.add(f"<|channel>thought\n{reasoning}\n<channel|>", role, "reasoning")
            elif role == "assistant" and opens and self.empty_thought and not self.thinking:
                out.add("<|channel>thought\n<channel|>", role, "header")
            calls = message.get("tool_calls") or ()
            if calls and role != "assistant":
                raise MaskError(f"{where}: only assistant messages carry tool_calls")
            names = {}
            for k, call in enumerate(calls):
                name, arguments = self._call(call, f"{where}.tool_calls[{k}]")
                names[call.get("id")] = name
                out.add(f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>", role, "tool_call")
            j = self._responses(body, i + 1, names, offset, out) if calls else i + 1
            content = message.get("content")
            content = "" if content is None and calls else self._plain(content, f"{where}.content").strip()
            out.add(content, role, "content")
            responded = j > i + 1
            following = body[j]["role"] if j < len(body) else None
            if calls and not responded:
                out.add("<|tool_response>", role, "end")
            elif not (following == "assistant" == role and (responded or not calls)):
                if not (responded and not content and following is None):
                    out.add("<turn|>\n", role, "end")
            previous, i = role, j
        return tuple(out.segments)

    def _responses(self, body, j, names, offset, out):
        # The tool messages from body[j] on, rendered inside the model turn; returns the index after them.
        first = j
        while j < len(body) and body[j]["role"] == "tool":
            tool, where = body[j], f"messages[{j + offset}]"
            name = names.get(tool.get("tool_call_id")) or tool.get("name") or "unknown"
            name = self._plain(name, f"{where}.name")
            # Only the first opener is the model's output: it stops there and the tool answers.
            out.add("<|tool_response>", *(("assistant", "end") if j == first else ("tool", "content")))
            value = self._value(self._plain(tool.get("content"), f"{where}.content"), where)
            out.add(f"response:{name}{{value:{value}}}<tool_response|>", "tool", "content")
            j += 1
        return j

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

    def _fields(self, mapping, where):
        # Keys sorted case-insensitively, as Jinja's dictsort does in the template.
        keys = sorted((self._plain(key, where) for key in mapping), key=str.lower)
        return ",".join(f"{key}:{self._value(mapping[key], where)}" for key in keys)

    def _value(self, value, where):
        # Gemma 4 writes tool values in its own notation: strings between <|"|> quotes, bare keys.
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return _QUOTE + self._plain(value, where) + _QUOTE
        if isinstance(value, Mapping):
            return "{" + self._fields(value, where) + "}"
        if isinstance(value, Sequence):
            return "[" + ",".join(self._value(item, where) for item in value) + "]"
        return str(value)


class _Segments:
    """Collects non-empty segments, stamping each with the current turn index."""

    def __init__(self):
        self.segments = []
        self.turn = -1

    def add(self, text, role, part):
        if text:
            self.segments.append(Segment(text, role, part, self.turn))
