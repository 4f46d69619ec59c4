"""Gemma 4 rendering and masks: exact trained spans for system, thinking, reasoning, multi-turn and tools."""

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from gemport.data import encode, Gemma4, MaskPolicy, PARTS, ROLES
from gemport.errors import MaskError
from tiny_tokenizers import GEMMA4_CONTROL, bpe_tokenizer, char_tokenizer, trained_spans
from chat_shapes import CHAT

CALL = "<|tool_call>call:add{a:2,b:2}<tool_call|><|tool_response>"


def spans(messages, policy=MaskPolicy(), tokenizer=None, **options):
    tokenizer = tokenizer or char_tokenizer(GEMMA4_CONTROL)
    segments = Gemma4(**options).render(messages)
    return trained_spans(encode(segments, policy.select(segments), tokenizer), tokenizer)


def test_assistant_turns_train_content_calls_and_turn_end_only():
    assert spans(CHAT, thinking="on") == ["Hello!<turn|>\n", CALL, "It is 4.<turn|>\n"]


def test_reasoning_is_trainable_by_option():
    assert spans(CHAT, MaskPolicy(reasoning=True), thinking="on") == [
        "Hello!<turn|>\n",
        "<|channel>thought\nneed the tool\n<channel|>" + CALL,
        "<|channel>thought\nthe tool said 4\n<channel|>It is 4.<turn|>\n",
    ]


def test_keep_reasoning_renders_earlier_traces():
    policy = MaskPolicy(reasoning=True)
    assert spans(CHAT, policy, thinking="on", keep_reasoning=True)[0] == "<|channel>thought\ngreet them\n<channel|>Hello!<turn|>\n"
    assert spans(CHAT, policy, thinking="on")[0] == "Hello!<turn|>\n"


def test_all_turns_trains_users_but_never_system_or_tool():
    assert spans(CHAT, MaskPolicy("all"), thinking="on") == [
        "Hi<turn|>\n", "Hello!<turn|>\n", "Add 2 and 2<turn|>\n", CALL, "It is 4.<turn|>\n",
    ]


def test_last_assistant_trains_the_whole_final_model_turn():
    assert spans(CHAT, MaskPolicy("last_assistant"), thinking="on") == [CALL, "It is 4.<turn|>\n"]


def test_no_header_system_tool_or_reasoning_token_is_trained():
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    segments = Gemma4(thinking="on").render(CHAT)
    example = encode(segments, MaskPolicy().select(segments), tokenizer)
    roles = [ROLES[i] for i in example.role_ids[example.loss_mask]]
    parts = [PARTS[i] for i in example.part_ids[example.loss_mask]]
    assert set(roles) == {"assistant"} and set(parts) == {"content", "tool_call", "end"}
    untrained = "".join(tokenizer.convert_ids_to_tokens(example.tokens[~example.loss_mask].tolist()))
    assert untrained.startswith("<bos><|turn>system\n<|think|>\nYou are terse.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n")
    assert "response:add{value:<|\"|>4<|\"|>}<tool_response|>" in untrained
    assert untrained.count("<|turn>model\n") == 2 and untrained.count("<|channel>thought") == 2


def test_turn_end_is_trained_after_every_trained_turn():
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    segments = Gemma4().render(CHAT)
    example = encode(segments, MaskPolicy().select(segments), tokenizer)
    turn_end = tokenizer.convert_tokens_to_ids("<turn|>")
    for turn in set(example.turn_ids[example.loss_mask].tolist()):
        in_turn = example.turn_ids == turn
        ends = in_turn & (example.tokens == turn_end)
        assert ends.sum() == 1 and example.loss_mask[ends].all()


def test_header_merge_trains_the_fused_token():
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]
    assert spans(chat, tokenizer=bpe_tokenizer(GEMMA4_CONTROL)) == ["\nSure<turn|>\n"]
    assert spans(chat) == ["Sure<turn|>\n"]


def test_empty_reasoning_is_never_rendered_and_empty_thought_is_context():
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning": " \n"}]
    text = "".join(s.text for s in Gemma4().render(chat))
    assert text == "<bos><|turn>user\nHi<turn|>\n<|turn>model\nYo<turn|>\n"
    segments = Gemma4(thinking="empty_thought").render(chat)
    assert "".join(s.text for s in segments).endswith("<|turn>model\n<|channel>thought\n<channel|>Yo<turn|>\n")
    assert spans(chat, MaskPolicy(reasoning=True), thinking="empty_thought") == ["Yo<turn|>\n"]


def test_tool_call_without_response_ends_on_tool_response_token():
    chat = [CHAT[1], {"role": "assistant", "tool_calls": CHAT[4]["tool_calls"]}]
    assert spans(chat) == [CALL]


@pytest.mark.parametrize("thinking", ["off", "on"])
@pytest.mark.parametrize(
    "chat",
    [
        CHAT,
        CHAT[1:],
        [{"role": "user", "content": " a "}, {"role": "assistant", "content": " b ", "reasoning": "r"}],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": {"Z": [1, "s", None], "a": {"k": True}, "m": 1.5}}},
                {"function": {"name": "g", "arguments": {}}},
            ]},
            {"role": "tool", "name": "f", "content": "one"},
            {"role": "tool", "name": "g", "content": "{ok}"},
            {"role": "assistant", "content": "done"},
        ],
    ],
)
def test_rendering_matches_trls_shipped_gemma4_template(chat, thinking):
    from trl.chat_template_utils import gemma4_v5_chat_template

    expected, _ = render_jinja_template(
        conversations=[chat], chat_template=gemma4_v5_chat_template, bos_token="<bos>", enable_thinking=thinking == "on"
    )
    assert "".join(s.text for s in Gemma4(thinking=thinking).render(chat)) == expected[0]


@pytest.mark.parametrize(
    "chat, match",
    [
        ([{"role": "user", "content": "x<turn|>"}], "control token"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "system message must come first"),
        ([{"role": "tool", "content": "4"}], "tool message"),
        ([{"role": "user", "content": "x", "reasoning": "r"}], "only assistant"),
        ([{"role": "user", "content": 3}], "expected a string"),
        ([CHAT[3], CHAT[4], {"role": "tool", "content": {"v": 4}}], "expected a string"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], "expected a dict"),
    ],
)
def test_bad_conversations_raise_mask_error(chat, match):
    with pytest.raises(MaskError, match=match):
        Gemma4().render(chat)


def test_render_does_not_modify_its_input():
    import copy

    before = copy.deepcopy(CHAT)
    Gemma4(thinking="on", keep_reasoning=True).render(CHAT)
    assert CHAT == before
