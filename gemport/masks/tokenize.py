"""Token labels from character offsets: the mask is decided on text, then carried to tokens.

Works with ``tokenizers.Tokenizer``, transformers fast tokenizers (through their backend) and
``sentencepiece.SentencePieceProcessor``: anything that reports where each token sits in the text.
"""

import itertools
from typing import NamedTuple

import numpy as np

from gemport.errors import MaskError
from gemport.masks.render import PARTS, ROLES


class Example(NamedTuple):
    """One tokenized conversation; every array is [n] with n the number of tokens.

    tokens: int32 token ids.
    loss_mask: bool; ``loss_mask[t]`` says token t is a trained *target*, predicted from position
        t - 1 (the convention of TRL's labels and of Tunix's ``input_mask``). ``loss_mask[0]`` is
        False: the first token has no predecessor.
    turn_ids: int32 index of the turn each token belongs to, -1 for ``<bos>``.
    role_ids: int8 index into ``ROLES``; part_ids: int8 index into ``PARTS``.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    turn_ids: np.ndarray
    role_ids: np.ndarray
    part_ids: np.ndarray


def token_offsets(tokenizer, text):
    """Tokenizes ``text`` without adding special tokens.

    Returns (ids int32 [n], starts int32 [n], ends int32 [n]): each token's character span
    ``text[start:end]``. Raises MaskError for a tokenizer that cannot report offsets.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode_batch"):
        encoding = backend.encode(text, add_special_tokens=False)
        spans = np.asarray(encoding.offsets, dtype=np.int32).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), spans[:, 0], spans[:, 1]
    if hasattr(tokenizer, "serialized_model_proto"):
        pieces = tokenizer.encode(text, return_type="proto").pieces
        ids = np.fromiter((p.id for p in pieces), dtype=np.int32, count=len(pieces))
        spans = np.fromiter((b for p in pieces for b in (p.begin, p.end)), np.int32, 2 * len(pieces))
        spans = _char_of_byte(text)[spans].reshape(-1, 2)
        return ids, spans[:, 0], spans[:, 1]
    raise MaskError(
        f"tokenizer: {type(tokenizer).__name__} reports no character offsets; pass a tokenizers.Tokenizer, "
        "a transformers fast tokenizer or a sentencepiece.SentencePieceProcessor"
    )


def _char_of_byte(text):
    # sentencepiece reports UTF-8 byte offsets; map each byte offset to its character index.
    widths = [len(c.encode("utf-8")) for c in text] if not text.isascii() else [1] * len(text)
    return np.repeat(np.arange(len(text) + 1, dtype=np.int32), widths + [1])


def check_tokenizer(tokenizer, chat_format):
    """Raises MaskError unless every control token of ``chat_format`` is one token of ``tokenizer``.

    A control token split into pieces would put text the model never saw in pretraining where its
    turn markers belong, and lets a merge cross a turn boundary.
    """
    seen = {}
    for token in chat_format.control_tokens:
        ids = token_offsets(tokenizer, token)[0]
        if len(ids) != 1:
            raise MaskError(
                f"tokenizer: {token!r} encodes to {len(ids)} tokens {ids.tolist()}; add the Gemma control "
                "tokens as special tokens"
            )
        if int(ids[0]) in seen:
            raise MaskError(f"tokenizer: {token!r} and {seen[int(ids[0])]!r} share the id {int(ids[0])}")
        seen[int(ids[0])] = token


_ROLE_ID = {name: i for i, name in enumerate(ROLES)}
_PART_ID = {name: i for i, name in enumerate(PARTS)}


def encode(segments, trained, tokenizer):
    """Tokenizes rendered ``segments`` and labels every token through character offsets.

    segments: sequence of ``Segment`` (from a chat format's ``render``); trained: bool [len(segments)]
    (from ``MaskPolicy.select``). A token is a target when any of its characters is trained, so a
    token that a merge stretches across a boundary (e.g. a header's ``\\n`` fused with the first
    word of the answer) is trained and the answer's first characters are never lost. A zero-width
    token (a sentencepiece byte piece or dummy prefix) takes the label of the character it stands
    before. Role, part and turn of a token are those of its last character.
    Returns an ``Example``.
    """
    return encode_batch([(segments, trained)], tokenizer)[0]


def encode_batch(items, tokenizer, add_special_tokens=False, tokenized=None):
    """``encode`` for many conversations at once: one batch call to the tokenizer, one labelling pass.

    items: sequence of (segments, trained) pairs, as ``encode`` takes them. add_special_tokens: let
    the tokenizer add its own special tokens (a ``<bos>`` for plain text, as TRL tokenizes its text
    formats); they are zero-width and take the label of the character they stand before.
    tokenized: ``tokenize_batch``'s result for these items' texts, when it was computed elsewhere
    (e.g. in another thread); None tokenizes here.
    Returns a list of ``Example``, one per item. A fast tokenizer's batch API tokenizes on all cores.
    """
    lengths, trained, table, text_lengths = [], [], [], []
    for k, (segments, flags) in enumerate(items):
        flags = np.asarray(flags, dtype=bool)
        if flags.shape != (len(segments),):
            raise MaskError(f"trained[{k}]: shape {flags.shape} for {len(segments)} segments")
        lengths.extend(len(s.text) for s in segments)
        text_lengths.append(sum(lengths[len(lengths) - len(segments):]))
        if not text_lengths[-1]:
            raise MaskError(f"segments[{k}]: the rendered text is empty")
        trained.append(flags)
        table.extend((s.turn, _ROLE_ID[s.role], _PART_ID[s.part]) for s in segments)
    if not items:
        return []
    if tokenized is None:
        tokenized = tokenize_batch(tokenizer, [text_of(segments) for segments, _ in items], add_special_tokens)
    counts, ids, starts, ends = tokenized
    if (counts == 0).any():
        raise MaskError(f"segments[{int(np.argmax(counts == 0))}]: the text tokenizes to nothing")
    lengths = np.asarray(lengths, dtype=np.int64)
    char_trained = np.repeat(np.concatenate(trained), lengths)
    # Token offsets become offsets into the concatenated texts of the whole batch.
    text_ends = np.cumsum(text_lengths)
    base = np.repeat(text_ends - text_lengths, counts)
    starts, ends = starts + base, ends + base
    trained_before = np.concatenate([[0], np.cumsum(char_trained)])
    owner = np.minimum(np.where(ends > starts, ends - 1, starts), np.repeat(text_ends - 1, counts))
    loss_mask = (trained_before[ends] > trained_before[starts]) | ((ends == starts) & char_trained[owner])
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # Nothing precedes an example's first token, so it cannot be a target whatever its segment says.
    loss_mask[firsts] = False
    segment_of = np.repeat(np.arange(len(lengths)), lengths)[owner]
    labels = np.asarray(table, dtype=np.int32)[segment_of]
    splits = firsts[1:]
    return [
        Example(*fields)
        for fields in zip(
            np.split(ids, splits),
            np.split(loss_mask, splits),
            np.split(labels[:, 0].copy(), splits),
            np.split(labels[:, 1].astype(np.int8), splits),
            np.split(labels[:, 2].astype(np.int8), splits),
        )
    ]


def text_of(segments):
    """The rendered text: the segments' texts joined."""
    return "".join(s.text for s in segments)


def tokenize_batch(tokenizer, texts, add_special_tokens=False):
    """Tokenizes ``texts`` (b strings) in one call.

    Returns (counts int64 [b], ids int32 [n], starts int64 [n], ends int64 [n]): the number of
    tokens of each text, then every token of the batch, text after text, with its character span
    in its own text. A fast tokenizer's batch call runs on all cores without holding the GIL.
    """
    if not texts:
        return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode_batch"):
        encodings = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        chain = itertools.chain.from_iterable
        ids = np.fromiter(chain(e.ids for e in encodings), dtype=np.int32, count=int(counts.sum()))
        spans = np.fromiter(chain(chain(e.offsets for e in encodings)), dtype=np.int64, count=2 * int(counts.sum()))
        spans = spans.reshape(-1, 2)
        return counts, ids, spans[:, 0], spans[:, 1]
    if add_special_tokens:
        raise MaskError(
            f"tokenizer: {type(tokenizer).__name__} cannot say which special tokens it adds; pass a "
            "tokenizers.Tokenizer or a transformers fast tokenizer"
        )
    parts = [token_offsets(tokenizer, text) for text in texts]
    counts = np.array([len(p[0]) for p in parts], dtype=np.int64)
    return counts, *(np.concatenate([p[k] for p in parts]).astype(np.int64 if k else np.int32) for k in range(3))
