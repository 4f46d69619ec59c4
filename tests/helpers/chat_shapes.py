"""Conversations the rendering tests share: ``CHAT`` (Gemma 4's system turn, reasoning and a tool call), ``SHAPES``
(every message shape TRL's templates render, with their ``TOOLS``) and ``conversations`` (a hypothesis strategy of
random ones)."""

from hypothesis import strategies as st

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning": "greet them"},
    {"role": "user", "content": "Add 2 and 2"},
    {
        "role": "assistant",
        "reasoning": "need the tool",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"b": 2, "a": 2}}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "4"},
    {"role": "assistant", "content": "It is 4.", "reasoning": "the tool said 4"},
]

TOOLS = [
    {"type": "function", "function": {
        "name": "weather", "description": "Weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"], "nullable": True},
            "days": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags"},
            "at": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        }},
    }},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
    {"type": "function", "function": {
        "name": "search", "description": "Search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        "response": {"type": "object", "description": "Hits"},
    }},
]
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": 2, "x": None}}}
TEXT_PARTS = [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]
SHAPES = {
    "developer": ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Yo"}], None),
    "content parts": ([{"role": "user", "content": TEXT_PARTS}, {"role": "assistant", "content": TEXT_PARTS}], None),
    "content None": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}], None),
    "tools": ([{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "assistant", "content": "Sunny."}], TOOLS),
    "tool parts and reasoning": ([{"role": "user", "content": "Weather?"},
                                  {"role": "assistant", "reasoning": "call it", "tool_calls": [CALL]},
                                  {"role": "tool", "name": "weather", "content": TEXT_PARTS},
                                  {"role": "assistant", "content": "Sunny.", "reasoning": "done"}], TOOLS[:1]),
    "call awaiting a response": ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]}], TOOLS[1:]),
    "assistant after assistant": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                   {"role": "assistant", "content": "c"}], None),
    "tool_responses on the message": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                       "tool_responses": [{"name": "f", "response": {"k": 1, "s": "v"}}]},
                                       {"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "ok", "reasoning": "r"}], None),
    "blank content beside a response": ([{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "  ", "tool_calls": [CALL]},
                                         {"role": "tool", "name": "weather", "content": "r"}], None),
}


MESSAGE_TEXT = st.sampled_from(["Hi", " a b ", "x\n", "model", "é"])
CONTENT = st.one_of(MESSAGE_TEXT, st.lists(MESSAGE_TEXT.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=2))


@st.composite
def conversations(draw):
    chat = [{"role": draw(st.sampled_from(["system", "developer"])), "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for turn in range(draw(st.integers(1, 3))):
        chat.append({"role": "user", "content": draw(CONTENT)})
        answer = {"role": "assistant", "content": draw(st.one_of(st.none(), CONTENT))}
        if draw(st.booleans()):
            answer["reasoning"] = draw(MESSAGE_TEXT)
        if draw(st.booleans()):
            answer["tool_calls"] = [dict(CALL, id=f"c{turn}")]
            chat.append(answer)
            chat.append({"role": "tool", "tool_call_id": f"c{turn}", "content": draw(CONTENT)})
            if draw(st.booleans()):
                chat.append({"role": "assistant", "content": draw(MESSAGE_TEXT)})
        else:
            chat.append(answer)
    return chat
