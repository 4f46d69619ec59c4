"""Tokenizers built in-process for the tests.

``char_tokenizer`` has one token per character (control tokens are single special tokens), so its
masks can be read character by character. ``bpe_tokenizer`` adds merges, some of which fuse a
header's newline with the first letters of the answer: a token that spans a segment boundary.
"""

import string

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from gemport.data import Gemma4

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
