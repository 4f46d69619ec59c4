"""Masks through merges and byte pieces equal a character-level reference."""

import io
import typing

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gemport.data import check_tokenizer, encode, Gemma3, Gemma4, MaskPolicy, Thinking, token_offsets
from gemport.errors import MaskError
from tiny_tokenizers import GEMMA3_CONTROL, GEMMA4_CONTROL, bpe_tokenizer, char_tokenizer

WORDS = st.sampled_from(["Sure", "It", "user", "model", "\n", "\n\n", " ", "x", "é", "ö", "use"])
TEXT = st.lists(WORDS, min_size=1, max_size=6).map("".join)


@st.composite
def chats(draw):
    turns = draw(st.integers(1, 3))
    chat = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(turns):
        chat.append({"role": "user", "content": draw(TEXT)})
        chat.append({"role": "assistant", "content": draw(TEXT), "reasoning": draw(TEXT)})
    return chat


POLICIES = st.builds(MaskPolicy, st.sampled_from(["assistant", "all", "last_assistant"]), st.booleans())
GEMMA4 = st.builds(Gemma4, st.sampled_from(typing.get_args(Thinking)), st.booleans())


def char_mask(segments, trained):
    """Per character of the rendered text: is it trained."""
    return np.repeat(trained, [len(s.text) for s in segments])


def reference(example, tokenizer, text, chars):
    """A token is a target when one of its characters is; a zero-width one when the next character is."""
    _, starts, ends = token_offsets(tokenizer, text)
    expected = [chars[s:e].any() if e > s else chars[min(s, len(text) - 1)] for s, e in zip(starts, ends)]
    expected[0] = False
    return expected


def test_char_tokenizer_mask_is_the_segment_mask():
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    segments = Gemma4().render(chat)
    example = encode(segments, MaskPolicy().select(segments), tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(example.tokens.tolist())
    assert [p for p, m in zip(pieces, example.loss_mask) if m] == ["Y", "o", "<turn|>", "\n"]


@settings(max_examples=60, deadline=None)
@given(chats(), POLICIES, GEMMA4)
def test_bpe_masks_equal_the_character_reference(chat, policy, chat_format):
    segments = chat_format.render(chat)
    trained = policy.select(segments)
    text = "".join(s.text for s in segments)
    chars = char_mask(segments, trained)
    tokenizer = bpe_tokenizer(GEMMA4_CONTROL)
    example = encode(segments, trained, tokenizer)
    assert example.loss_mask.tolist() == reference(example, tokenizer, text, chars)
    # Merges only ever widen a trained span to whole tokens: every trained character is covered.
    _, starts, ends = token_offsets(tokenizer, text)
    covered = np.zeros(len(text), bool)
    for s, e, m in zip(starts, ends, example.loss_mask):
        covered[s:e] |= m
    assert not (chars & ~covered).any()


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    corpus = ["Sure it is, user", "model\nSure", "use the model", "x y z"] * 40
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=300, model_type="bpe",
        user_defined_symbols=GEMMA3_CONTROL, byte_fallback=True, bos_id=-1, eos_id=-1, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_by_whitespace=False,
        add_dummy_prefix=False, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@settings(max_examples=40, deadline=None)
@given(chat=chats(), policy=POLICIES)
def test_sentencepiece_masks_equal_the_character_reference(sentencepiece_tokenizer, chat, policy):
    chat = [{k: v for k, v in m.items() if k != "reasoning"} for m in chat]
    segments = Gemma3().render(chat)
    trained = policy.select(segments)
    text = "".join(s.text for s in segments)
    example = encode(segments, trained, sentencepiece_tokenizer)
    assert example.tokens.tolist() == sentencepiece_tokenizer.encode(text)
    expected = reference(example, sentencepiece_tokenizer, text, char_mask(segments, trained))
    assert example.loss_mask.tolist() == expected


def test_sentencepiece_byte_pieces_of_a_trained_character_are_trained(sentencepiece_tokenizer):
    check_tokenizer(sentencepiece_tokenizer, Gemma3())
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ö"}]
    segments = Gemma3().render(chat)
    example = encode(segments, MaskPolicy().select(segments), sentencepiece_tokenizer)
    pieces = [sentencepiece_tokenizer.id_to_piece(int(i)) for i in example.tokens[example.loss_mask]]
    assert pieces == ["<0xC3>", "<0xB6>", "<end_of_turn>", "\n"]


def test_tokenizer_without_offsets_raises():
    with pytest.raises(MaskError, match="offsets"):
        token_offsets(object(), "x")
