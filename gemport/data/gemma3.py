"""The Gemma 2/3 chat format: ``<start_of_turn>user|model\\n ... <end_of_turn>\\n``, no system role."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from gemport.errors import MaskError
from gemport.data.render import SYSTEM_ROLES, Segment, check_messages, check_tools, text_parts

_UNSUPPORTED_KEYS = ("reasoning", "reasoning_content", "tool_calls", "tool_responses")


@dataclasses.dataclass(frozen=True)
class Gemma3:
    """Renders conversations as Gemma 2/3 chat templates do.

    A leading system (or ``developer``) message becomes a prefix of the first user turn
    (``system + "\\n\\n"``, role ``system``; of a list of parts, the first part's text, untrimmed,
    as the template does). Turns must alternate user/assistant, starting with user. ``content`` is a
    string or a list of text parts, each trimmed and joined without a separator. Gemma 3 has no
    reasoning channel and no tool syntax: messages carrying either, and tool declarations, raise
    MaskError.
    """

    control_tokens = ("<bos>", "<start_of_turn>", "<end_of_turn>")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> tuple[Segment, ...]:
        """Returns the ``Segment``s of ``messages`` (list of {"role", "content"}); the input is not modified.

        add_generation_prompt: end with ``<start_of_turn>model\\n`` (context, never a target), as a
        prompt is rendered before its completion.
        """
        check_messages(messages)
        if check_tools(tools):
            raise MaskError("tools: Gemma 3's chat template has no format for tool declarations; use Gemma4")
        segments = [Segment("<bos>", "", "bos", -1)]
        prefix = ""
        turns = list(messages)
        if turns and turns[0]["role"] in SYSTEM_ROLES:
            prefix = text_parts(turns[0].get("content"), "messages[0].content", self.control_tokens)
            if not prefix:
                raise MaskError("messages[0].content: an empty list of parts")
            prefix = prefix[0] + "\n\n"
            turns = turns[1:]
        offset = len(messages) - len(turns)
        for turn, message in enumerate(turns):
            where = f"messages[{turn + offset}]"
            expected = "user" if turn % 2 == 0 else "assistant"
            if message["role"] != expected:
                raise MaskError(
                    f"{where}: role {message['role']!r} where Gemma 3 needs {expected!r}; "
                    "turns must alternate user/assistant after an optional leading system message"
                )
            for key in _UNSUPPORTED_KEYS:
                if message.get(key):
                    raise MaskError(f"{where}: Gemma 3 has no format for {key!r}; use Gemma4 or drop it")
            texts = text_parts(message.get("content"), f"{where}.content", self.control_tokens)
            content = "".join(t.strip() for t in texts)
            role = message["role"]
            header = "<start_of_turn>" + ("model" if role == "assistant" else "user") + "\n"
            segments.append(Segment(header, role, "header", turn))
            if turn == 0 and prefix:
                segments.append(Segment(prefix, "system", "content", turn))
            if content:
                segments.append(Segment(content, role, "content", turn))
            segments.append(Segment("<end_of_turn>\n", role, "end", turn))
        if add_generation_prompt:
            segments.append(Segment("<start_of_turn>model\n", "assistant", "header", len(turns)))
        return tuple(segments)
