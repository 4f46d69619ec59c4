"""The Gemma 2/3 chat format: ``<start_of_turn>user|model\\n ... <end_of_turn>\\n``, no system role."""

import dataclasses

from gemport.errors import MaskError
from gemport.masks.render import Segment, check_messages, check_plain

_UNSUPPORTED_KEYS = ("reasoning", "reasoning_content", "tool_calls")


@dataclasses.dataclass(frozen=True)
class Gemma3:
    """Renders conversations as Gemma 2/3 chat templates do.

    A leading system message becomes a prefix of the first user turn (``system + "\\n\\n"``, role
    ``system``). Turns must alternate user/assistant, starting with user. Gemma 3 has no reasoning
    channel and no tool-call syntax: messages carrying either raise MaskError.
    """

    control_tokens = ("<bos>", "<start_of_turn>", "<end_of_turn>")

    def render(self, messages):
        """Returns the ``Segment``s of ``messages`` (list of {"role", "content"}); the input is not modified."""
        check_messages(messages)
        segments = [Segment("<bos>", "", "bos", -1)]
        prefix = ""
        turns = list(messages)
        if turns and turns[0]["role"] == "system":
            prefix = check_plain(turns[0].get("content"), "messages[0].content", self.control_tokens) + "\n\n"
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
            content = check_plain(message.get("content"), f"{where}.content", self.control_tokens).strip()
            role = message["role"]
            header = "<start_of_turn>" + ("model" if role == "assistant" else "user") + "\n"
            segments.append(Segment(header, role, "header", turn))
            if turn == 0 and prefix:
                segments.append(Segment(prefix, "system", "content", turn))
            if content:
                segments.append(Segment(content, role, "content", turn))
            segments.append(Segment("<end_of_turn>\n", role, "end", turn))
        return tuple(segments)
