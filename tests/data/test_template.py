"""Rendering equals each chat template TRL ships, byte for byte; the tokenizer's template picks the format.

Every Gemma 4 revision (TRL's gemma4.jinja, gemma4_v2 ... v5) and Gemma 3's template render the
new message shapes (developer, content parts, content None, tool declarations, tool calls and
responses in both styles, assistant after assistant) with and without thinking and the generation
prompt; ``chat_format`` picks the revision from a tokenizer carrying the template, and
``check_template`` names the conversation and character where a wrong choice differs.
"""

import copy
import warnings

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from gemport.data import Gemma3, Gemma4, Truncation
from gemport import errors
from gemport.errors import MaskError
from gemport.data import template
from tiny_tokenizers import GEMMA3_CONTROL, GEMMA4_CONTROL, char_tokenizer
from chat_shapes import CALL, SHAPES, TEXT_PARTS, TOOLS, conversations

trl_templates = pytest.importorskip("trl.chat_template_utils")
GEMMA4 = {
    1: trl_templates.gemma4_chat_template,
    2: trl_templates.gemma4_v2_chat_template,
    3: trl_templates.gemma4_v3_chat_template,
    4: trl_templates.gemma4_v4_chat_template,
    5: trl_templates.gemma4_v5_chat_template,
}


def text(chat_format, chat, tools=None, **options):
    return "".join(s.text for s in chat_format.render(chat, tools, **options))


def jinja(chat_template, chat, tools=None, **options):
    rendered, _ = render_jinja_template(
        conversations=[chat], tools=tools, chat_template=chat_template, bos_token="<bos>", **options
    )
    return rendered[0]


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("revision", sorted(GEMMA4))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_gemma4_revision_renders_every_message_shape_as_its_template(shape, revision, thinking, generation_prompt):
    chat, tools = SHAPES[shape]
    chat_format = Gemma4(thinking="on" if thinking else "off", revision=revision)
    options = dict(enable_thinking=thinking, add_generation_prompt=generation_prompt)
    assert text(chat_format, chat, tools, add_generation_prompt=generation_prompt) == jinja(GEMMA4[revision], chat, tools, **options)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=conversations(), revision=st.sampled_from(sorted(GEMMA4)), thinking=st.booleans(), tools=st.booleans())
def test_random_conversations_render_as_each_revision(chat, revision, thinking, tools):
    # Revisions 2 and 3 print a list of system parts as its repr: gemport refuses those instead.
    assume(not (revision in (2, 3) and chat[0]["role"] != "user" and not isinstance(chat[0]["content"], str)))
    tools = TOOLS if tools else None
    expected = jinja(GEMMA4[revision], chat, tools, enable_thinking=thinking)
    assert text(Gemma4(thinking="on" if thinking else "off", revision=revision), chat, tools) == expected


@pytest.mark.parametrize("shape", ["content parts", "developer"])
def test_gemma3_renders_content_parts_and_developer_as_its_template(shape):
    chat, _ = SHAPES[shape]
    expected_chat = [dict(m, role="system") if m["role"] == "developer" else m for m in chat]
    expected = jinja(trl_templates.gemma3_chat_template, expected_chat, add_generation_prompt=True)
    # Gemma 3's template refuses a developer message; gemport renders it as the system message it is.
    assert text(Gemma3(), chat, add_generation_prompt=True) == expected
    system_parts = [{"role": "system", "content": [{"type": "text", "text": " S "}, {"type": "text", "text": "T"}]}] + chat[-2:]
    assert text(Gemma3(), system_parts) == jinja(trl_templates.gemma3_chat_template, system_parts)


@pytest.mark.parametrize("chat_format, chat, tools, match", [
    (Gemma4(), [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], None,
     r"messages\[0\]\.content\[0\]: a 'image_url' part"),
    (Gemma4(), [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]},
                      {"role": "tool", "content": [{"type": "audio", "audio": "a.wav"}]}], None,
     r"messages\[2\]\.content\[0\]: a 'audio' part"),
    (Gemma3(), [{"role": "user", "content": [{"type": "image"}]}], None, r"messages\[0\]\.content\[0\]: a 'image'"),
    (Gemma3(), [{"role": "user", "content": "q"}], TOOLS, "no format for tool declarations"),
    (Gemma4(), [{"role": "user", "content": "q"}], [{"name": "f"}], r"tools\[0\]"),
    (Gemma4(), [{"role": "user", "content": "q"}], [{"function": {"name": "f", "description": "<|tool>"}}],
     r"tools\[0\]\.function\.description: contains the control token"),
    (Gemma4(revision=2), [{"role": "system", "content": TEXT_PARTS}], None, "revision 2"),
])
def test_unrenderable_input_raises_mask_error_naming_it(chat_format, chat, tools, match):
    with pytest.raises(MaskError, match=match):
        chat_format.render(chat, tools)


def test_render_does_not_modify_its_input():
    chat, tools = SHAPES["tools"]
    before = copy.deepcopy((chat, tools))
    Gemma4(thinking="on").render(chat, tools, add_generation_prompt=True)
    assert (chat, tools) == before


def tokenizer_with(chat_template, control=GEMMA4_CONTROL):
    tok = char_tokenizer(control)
    tok.chat_template = chat_template
    return tok


@pytest.mark.parametrize("revision", sorted(GEMMA4))
def test_chat_format_picks_the_tokenizers_revision(revision):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chat_format = template.chat_format(tokenizer_with(GEMMA4[revision]), thinking="on")
    # Revisions 1 and 4 differ only on media parts, which gemport refuses: either renders alike.
    assert chat_format.revision == (4 if revision == 1 else revision) and chat_format.thinking == "on"
    assert isinstance(template.chat_format(tokenizer_with(trl_templates.gemma3_chat_template, GEMMA3_CONTROL)), Gemma3)


def test_chat_format_refuses_other_templates():
    with pytest.raises(MaskError, match="no chat template"):
        template.chat_format(char_tokenizer(GEMMA4_CONTROL))
    with pytest.raises(MaskError, match="neither Gemma 3"):
        template.chat_format(tokenizer_with("{{ messages[0]['content'] }}"))


def test_check_template_names_the_conversation_and_character():
    tok = tokenizer_with(GEMMA4[1])
    sample = [SHAPES["content None"][0], {"messages": SHAPES["assistant after assistant"][0]}]
    assert template.check_template(tok, Gemma4(revision=1), sample) is None
    expected = jinja(GEMMA4[1], sample[1]["messages"])
    offset = expected.index("<turn|>\nc")
    with pytest.warns(errors.TemplateMismatchWarning, match=rf"conversation 1: .* from character {offset}:"):
        assert template.check_template(tok, Gemma4(revision=5), sample) == (1, offset)
    with pytest.raises(errors.TemplateMismatchError, match="conversation 1"):
        template.check_template(tok, Gemma4(revision=5), sample, on_mismatch="raise")


def test_examples_check_the_tokenizers_template_first():
    from gemport.data import dataset

    tok = tokenizer_with(GEMMA4[1])
    records = [{"messages": SHAPES["assistant after assistant"][0]}]
    with pytest.raises(errors.TemplateMismatchError, match="conversation 0"):
        dataset.examples(records, tok, Gemma4(), Truncation(64), check="raise", progress=False)
    with pytest.warns(errors.TemplateMismatchWarning):
        dataset.examples(records, tok, Gemma4(), Truncation(64), progress=False)
