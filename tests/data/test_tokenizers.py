"""The tokenizers built in-process for the mask tests (tests/helpers/tiny_tokenizers.py) are what the tests need.

``char_tokenizer`` has one token per character (control tokens are single special tokens), so its
masks can be read character by character. ``bpe_tokenizer`` adds merges, some of which fuse a
header's newline with the first letters of the answer: a token that spans a segment boundary.
"""

import numpy as np
import pytest

from gemport.data import check_tokenizer, Gemma3, Gemma4, token_offsets
from gemport.errors import MaskError
from tiny_tokenizers import GEMMA3_CONTROL, GEMMA4_CONTROL, bpe_tokenizer, char_tokenizer


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
