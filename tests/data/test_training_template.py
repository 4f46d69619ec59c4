"""gemport's Gemma 4 training template: the text of TRL's shipped Gemma 4 template, and TRL's
assistant_only_loss masks with it equal to gemport's masks (thinking off and on)."""

import copy

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers.utils.chat_template_utils import render_jinja_template
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import gemma4_v5_chat_template, has_generation_markers

from gemport.data import encode, Gemma4, MaskPolicy
from gemport.data.training_template import gemma4_training_template
from chat_shapes import CHAT
from chat_shapes import SHAPES, TOOLS, conversations
from tiny_tokenizers import GEMMA4_CONTROL, bpe_tokenizer, char_tokenizer

TEMPLATE = gemma4_training_template()
CHATS = {"masks chat": (CHAT, None), "masks chat without system": (CHAT[1:], None), **SHAPES}


def jinja(chat_template, chat, tools=None, **options):
    rendered, spans = render_jinja_template(
        conversations=[chat], tools=tools, chat_template=chat_template, bos_token="<bos>",
        return_assistant_tokens_mask=True, **options,
    )
    return rendered[0], spans[0]


def test_the_template_is_package_data_with_generation_markers():
    assert has_generation_markers(TEMPLATE) and not has_generation_markers(gemma4_v5_chat_template)


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("shape", sorted(CHATS))
def test_renders_the_text_of_trls_gemma4_template(shape, thinking, generation_prompt):
    chat, tools = CHATS[shape]
    options = dict(enable_thinking=thinking, add_generation_prompt=generation_prompt)
    expected, _ = jinja(gemma4_v5_chat_template, chat, tools, **options)
    assert jinja(TEMPLATE, chat, tools, **options)[0] == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=conversations(), thinking=st.booleans(), tools=st.booleans())
def test_random_conversations_render_as_trls_template(chat, thinking, tools):
    tools = TOOLS if tools else None
    expected, _ = jinja(gemma4_v5_chat_template, chat, tools, enable_thinking=thinking)
    assert jinja(TEMPLATE, chat, tools, enable_thinking=thinking)[0] == expected


def gemport_mask(tokenizer, chat, tools=None, policy=MaskPolicy(), **options):
    segments = Gemma4(**options).render(chat, tools)
    return encode(segments, policy.select(segments), tokenizer)


@pytest.mark.parametrize("tokenizer", [char_tokenizer, bpe_tokenizer])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("shape", sorted(CHATS))
def test_assistant_masks_equal_gemports(shape, thinking, tokenizer):
    chat, tools = CHATS[shape]
    tokenizer = tokenizer(GEMMA4_CONTROL)
    tokenizer.chat_template = TEMPLATE
    out = tokenizer.apply_chat_template(chat, tools=tools, enable_thinking=thinking, return_dict=True,
                                        return_assistant_tokens_mask=True, tokenize=True)
    expected = gemport_mask(tokenizer, chat, tools, thinking="on" if thinking else "off")
    np.testing.assert_array_equal(out["input_ids"], expected.tokens)
    np.testing.assert_array_equal(np.asarray(out["assistant_masks"], bool), expected.loss_mask)


@pytest.mark.parametrize("variables, options", [
    (dict(keep_reasoning=True), dict(keep_reasoning=True)),
    (dict(empty_thought=True), dict(thinking="empty_thought")),
])
def test_gemport_options_render_and_mask_alike(variables, options):
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    tokenizer.chat_template = TEMPLATE
    out = tokenizer.apply_chat_template(CHAT[1:], return_dict=True, return_assistant_tokens_mask=True, **variables)
    expected = gemport_mask(tokenizer, CHAT[1:], **options)
    np.testing.assert_array_equal(out["input_ids"], expected.tokens)
    np.testing.assert_array_equal(np.asarray(out["assistant_masks"], bool), expected.loss_mask)


def test_train_reasoning_marks_reasoning_too():
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    tokenizer.chat_template = TEMPLATE
    out = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True,
                                        enable_thinking=True, train_reasoning=True)
    expected = gemport_mask(tokenizer, CHAT, policy=MaskPolicy(reasoning=True), thinking="on")
    np.testing.assert_array_equal(np.asarray(out["assistant_masks"], bool), expected.loss_mask)


@pytest.mark.parametrize("thinking", [False, True])
def test_trl_sft_trainer_trains_gemports_tokens(hf_checkpoint, tmp_path, thinking):
    """TRL 1.16 refuses assistant_only_loss with its own Gemma 4 template; with this one its labels are gemport's."""
    # SFTTrainer sets its model's config.pad_token_id; the session's model is shared with other modules.
    model = copy.deepcopy(hf_checkpoint("gemma4_dense")[0])
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    chats = [CHAT, CHAT[1:], SHAPES["tools"][0], SHAPES["assistant after assistant"][0]]
    rows = [{"messages": chat, "chat_template_kwargs": {"enable_thinking": thinking}} for chat in chats]
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, report_to="none",
                     use_cpu=True, bf16=False)
    tokenizer.chat_template = gemma4_v5_chat_template
    with pytest.raises(ValueError, match="training"):
        SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    tokenizer.chat_template = TEMPLATE
    dataset = datasets.Dataset.from_list(rows)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    # Arrow gives every message every key seen in the column (None where absent): render what TRL renders.
    for record, prepared in zip(dataset, trainer.train_dataset):
        expected = gemport_mask(tokenizer, record["messages"], thinking="on" if thinking else "off")
        np.testing.assert_array_equal(prepared["input_ids"], expected.tokens)
        np.testing.assert_array_equal(np.asarray(prepared["labels"]) != -100, expected.loss_mask)
