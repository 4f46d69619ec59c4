"""Tokenizers built in-process for the mask tests, and checks that they are what the tests need.

``char_tokenizer`` has one token per character (control tokens are single special tokens), so its
masks can be read character by character. ``bpe_tokenizer`` adds merges, some of which fuse a
header's newline with the first letters of the answer: a token that spans a segment boundary.
"""

import string

import numpy as np
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from gemport.data import check_tokenizer, Gemma3, Gemma4, token_offsets
from gemport.errors import MaskError

GEMMA3_CONTROL = ["<bos>", "<start_of_turn>", "<end_of_turn>", "<pad>"]
GEMMA4_CONTROL = list(Gemma4.control_tokens) + ["<pad>"]
ALPHABET = sorted(set(string.printable) | {"é", "ö"})
MERGES = [("\n", "S"), ("\nS", "u"), ("\nSu", "r"), ("\nSur", "e"), ("\n", "I"), ("\nI", "t"), ("u", "s"),
          ("us", "e"), ("use", "r"), ("m", "o"), ("mo", "d"), ("mod", "e"), ("mode", "l"), ("\n", "\n")]


def _tokenizer(control, merges):
    vocab = {}
    for piece in ["<unk>"] + ALPHABET:
        vocab[piece] = len(vocab)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.add_special_tokens(control)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>"
    )


def char_tokenizer(control):
    """One token per character; ``control`` strings are single special tokens."""
    return _tokenizer(control, [])


def bpe_tokenizer(control):
    """``char_tokenizer`` plus ``MERGES``, some of which cross a header/answer boundary."""
    return _tokenizer(control, MERGES)


def trained_spans(example, tokenizer):
    """The text of each maximal run of trained tokens, in order."""
    pieces = tokenizer.convert_ids_to_tokens(example.tokens.tolist())
    runs, current = [], []
    for piece, trained in zip(pieces, example.loss_mask.tolist()):
        if trained:
            current.append(piece)
        elif current:
            runs.append("".join(current))
            current = []
    return runs + (["".join(current)] if current else [])


def test_control_tokens_are_single_tokens():
    """Both test tokenizers give each control token one id of its own, which check_tokenizer accepts."""
    for control, chat_format in ((GEMMA3_CONTROL, Gemma3()), (GEMMA4_CONTROL, Gemma4())):
        for tokenizer in (char_tokenizer(control), bpe_tokenizer(control)):
            ids = [tokenizer.encode(t, add_special_tokens=False) for t in chat_format.control_tokens]
            assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids)
            assert [tokenizer.decode(i) for i in ids] == list(chat_format.control_tokens)
            check_tokenizer(tokenizer, chat_format)


def test_check_tokenizer_rejects_split_control_tokens():
    with pytest.raises(MaskError, match="<|turn>"):
        check_tokenizer(char_tokenizer(GEMMA3_CONTROL), Gemma4())


def test_bpe_merges_across_the_model_header():
    text = "<start_of_turn>model\nSure"
    ids, starts, ends = token_offsets(bpe_tokenizer(GEMMA3_CONTROL), text)
    spans = [text[s:e] for s, e in zip(starts, ends)]
    assert spans == ["<start_of_turn>", "model", "\nSure"]
    assert np.array_equal(ids, bpe_tokenizer(GEMMA3_CONTROL).encode(text, add_special_tokens=False))
