"""Token spans computed from token ids (``piece_lengths``) equal the tokenizer's own offsets.

``build`` takes ids from the fast tokenizer's offset-free batch call and computes each token's span
from a per-id length table; a text whose lengths do not add up is tokenized again with offsets, and
a tokenizer whose pipeline could make the table wrong gets real offsets throughout.
"""

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import GemmaTokenizer, PreTrainedTokenizerFast

from gemport.data import build, encode, Gemma3, MaskPolicy, Truncation
from gemport.data.tokenize import piece_lengths, tokenize_batch
from tiny_tokenizers import GEMMA3_CONTROL, bpe_tokenizer

PIECES = ["Sure", "use", "model", "a", " ", "\n", "é", "ö", "日本", "😀", "▁", "<unk>", "<0x41>", "x y",
          "<start_of_turn>", "<end_of_turn>"]
TEXTS = st.lists(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8).map("".join), min_size=1, max_size=6)
NON_ASCII = ["Sure é ö", "日本 😀 model", "ab\n😀"]


def gemma_like():
    """transformers' GemmaTokenizer (Replace " " -> "▁", BPE with byte fallback) on a tiny vocabulary:
    "日", "本" and "😀" are not in it, so they become byte pieces <0xNN>."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    merges = [("▁", "a"), ("\n", "S"), ("u", "s"), ("us", "e"), ("▁", "▁")]
    for piece in [*"abcdefghijklmnopqrstuvwxyzSIM▁\néö", *(left + right for left, right in merges)]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_CONTROL[1:3]})
    return tokenizer


def spaced():
    """Gemma's normalizer without byte fallback: an unknown character is <unk>."""
    tokenizer = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁": 1, "a": 2}, merges=[], unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.add_special_tokens(GEMMA3_CONTROL)
    return tokenizer


@functools.cache
def byte_level():
    """A byte-level BPE trained here, as GPT-2-style tokenizers are built."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<unk>", *GEMMA3_CONTROL],
    )
    bpe.train_from_iterator(["Sure, use the model.", "model\nSure é ö 日本", "x y z"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def eligible():
    return {
        "bpe": bpe_tokenizer(GEMMA3_CONTROL), "gemma": gemma_like(), "byte_level": byte_level(), "spaced": spaced()
    }


def test_eligible_tokenizers_have_a_table(eligible):
    for name, tokenizer in eligible.items():
        assert piece_lengths(tokenizer) is not None, name


@settings(max_examples=60, deadline=None)
@given(texts=TEXTS)
def test_spans_from_lengths_equal_the_tokenizers_offsets(eligible, texts):
    for tokenizer in eligible.values():
        fast = tokenize_batch(tokenizer, texts, lengths=piece_lengths(tokenizer))
        real = tokenize_batch(tokenizer, texts)
        for a, b in zip(fast, real, strict=True):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()


def test_table_is_exact_on_byte_pieces_and_non_ascii(eligible):
    # The lengths add up, so these spans come from the table, not from tokenizing again.
    for name in ("gemma", "byte_level"):
        tokenizer = eligible[name]
        backend = tokenizer.backend_tokenizer
        for text in NON_ASCII:
            ids = backend.encode(text, add_special_tokens=False).ids
            assert piece_lengths(tokenizer)[ids].sum() == len(text.encode()), (name, text)
    pieces = eligible["gemma"].convert_ids_to_tokens(eligible["gemma"].encode("😀", add_special_tokens=False))
    assert pieces == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


def test_texts_the_table_cannot_span_are_tokenized_again(eligible):
    # A literal "▁" is 3 bytes the table counts as 1 (a space); "ü" is unknown to this BPE (<unk>,
    # counted 0). Their texts take the tokenizer's offsets, the others keep the table's. Counted as
    # its 5 characters, each <unk> of "üü▁▁▁" would make up for two ▁ and the sum would match.
    cases = {
        "gemma": ["a b", "x ▁ y", "é"], "bpe": ["Sure", "über", "model"], "spaced": ["a a", "üü▁▁▁", "a"]
    }
    for name, texts in cases.items():
        tokenizer = eligible[name]
        table = piece_lengths(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        sums = [table[backend.encode(t, add_special_tokens=False).ids].sum() for t in texts]
        assert [s == len(t.encode()) for s, t in zip(sums, texts)] == [True, False, True]
        fast, real = tokenize_batch(tokenizer, texts, lengths=table), tokenize_batch(tokenizer, texts)
        assert all(a.tolist() == b.tolist() for a, b in zip(fast, real, strict=True))


def trimming():
    """``byte_level`` with GPT-2's post-processor, which trims spaces off the offsets."""
    tokenizer = Tokenizer.from_str(byte_level().backend_tokenizer.to_str())
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    return tokenizer


def metaspace():
    tokenizer = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁": 1, "a": 2}, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    return tokenizer


def nfkc():
    tokenizer = bpe_tokenizer(GEMMA3_CONTROL)
    tokenizer.backend_tokenizer.normalizer = normalizers.NFKC()
    return tokenizer


@pytest.mark.parametrize(
    "make",
    [
        trimming,
        metaspace,
        nfkc,
        lambda: Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##a": 2}, unk_token="[UNK]")),
    ],
    ids=["trim_offsets", "metaspace_prepend", "nfkc", "wordpiece"],
)
def test_tokenizers_the_table_could_misread_get_real_offsets(make):
    assert piece_lengths(make()) is None


def test_trimmed_offsets_differ_from_lengths():
    # Why trim_offsets declines: the tokenizer's own span of " model" leaves out its space.
    sizes = piece_lengths(byte_level())
    _, ids, starts, ends = tokenize_batch(trimming(), ["Sure, use the model"])
    assert ends.tolist() == np.cumsum(sizes[ids]).tolist()
    assert starts.tolist() != (np.cumsum(sizes[ids]) - sizes[ids]).tolist()


def test_sentencepiece_processor_gets_real_offsets():
    spm = pytest.importorskip("sentencepiece")
    assert piece_lengths(spm.SentencePieceProcessor()) is None


CHATS = [
    [{"role": "user", "content": "Sure é?"}, {"role": "assistant", "content": "日本 😀 model"}],
    [
        {"role": "system", "content": "use ö"},
        {"role": "user", "content": "x ▁ y"},
        {"role": "assistant", "content": "😀"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "Sure\n\nab"},
    ],
    [{"role": "user", "content": "model"}, {"role": "assistant", "content": "Sure a b"}],
]


@pytest.mark.parametrize("name", ["gemma", "bpe", "byte_level"])
def test_build_equals_encode_with_the_tokenizers_offsets(eligible, name):
    tokenizer = eligible[name]
    policy = MaskPolicy("all")
    examples, report = build(CHATS, tokenizer, Gemma3(), policy, Truncation(4096), batch_size=2)
    assert report.kept == len(CHATS)
    for example, chat in zip(examples, CHATS, strict=True):
        segments = Gemma3().render(chat)
        expected = encode(segments, policy.select(segments), tokenizer)
        assert all(a.tolist() == b.tolist() for a, b in zip(example, expected, strict=True))


def test_gemma_like_non_ascii_masks_equal_trl_template_path(eligible):
    from trl.chat_template_utils import gemma3_training_chat_template

    tokenizer = eligible["gemma"]
    examples, _ = build(CHATS, tokenizer, Gemma3(), MaskPolicy(), Truncation(4096))
    for example, chat in zip(examples, CHATS, strict=True):
        theirs = tokenizer.apply_chat_template(
            chat, chat_template=gemma3_training_chat_template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, bos_token="<bos>",
        )
        assert example.tokens.tolist() == theirs["input_ids"]
        assert example.loss_mask.astype(int).tolist() == theirs["assistant_masks"]
    # The comparison covers byte pieces in a trained answer.
    pieces = tokenizer.convert_ids_to_tokens(examples[0].tokens[examples[0].loss_mask].tolist())
    assert "<0xF0>" in pieces and "<0x80>" in pieces


def test_truncation_left_on_the_tokenizer_by_an_earlier_call_is_ignored(eligible):
    """transformers keeps a call's truncation/padding on the backend; build must not cut conversations by it
    (nor lose the table: spans still come from ids)."""
    tokenizer = eligible["gemma"]
    table = piece_lengths(tokenizer)
    policy, truncation = MaskPolicy("all"), Truncation(4096)
    before, _ = build(CHATS, tokenizer, Gemma3(), policy, truncation)
    tokenizer("a long enough text to cut", truncation=True, max_length=4, padding="max_length")
    assert tokenizer.backend_tokenizer.truncation and tokenizer.backend_tokenizer.padding
    try:
        assert piece_lengths(tokenizer).tolist() == table.tolist()
        after, report = build(CHATS, tokenizer, Gemma3(), policy, truncation)
        assert report.kept == len(CHATS)
        for a, b in zip(after, before, strict=True):
            assert all(x.tolist() == y.tolist() for x, y in zip(a, b, strict=True))
        assert tokenizer.backend_tokenizer.truncation["max_length"] == 4  # the user's tokenizer is left as it was
    finally:
        tokenizer.backend_tokenizer.no_truncation()
        tokenizer.backend_tokenizer.no_padding()
