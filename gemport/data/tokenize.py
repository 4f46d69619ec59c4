"""Token labels from character offsets: the mask is decided on text, then carried to tokens.

Works with ``tokenizers.Tokenizer``, transformers fast tokenizers (through their backend) and
``sentencepiece.SentencePieceProcessor``: anything that reports where each token sits in the text.
"""

import copy
import itertools
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gemport.errors import MaskError
from gemport.data.render import PARTS, ROLES, Segment


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


_PLAIN = {}  # id(backend) -> (backend, its truncation and padding, a copy without them)


def backend_of(tokenizer: Any) -> Any:
    """The tokenizer gemport calls: a transformers fast tokenizer's ``backend_tokenizer``, or ``tokenizer``.

    transformers leaves the truncation and padding of a call such as ``tokenizer(x, truncation=True,
    max_length=4)`` set on its backend, where they would cut every later text; gemport truncates by turns
    itself, so it then calls a copy without them (made once per such setting; the user's tokenizer is not
    changed).
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "no_truncation") or not (backend.truncation or backend.padding):
        return backend
    setting = (repr(backend.truncation), repr(backend.padding))
    cached = _PLAIN.get(id(backend))
    if cached is None or cached[0] is not backend or cached[1] != setting:
        plain = copy.deepcopy(backend)
        plain.no_truncation()
        plain.no_padding()
        if len(_PLAIN) >= 4:
            _PLAIN.clear()
        _PLAIN[id(backend)] = cached = (backend, setting, plain)
    return cached[2]


def token_offsets(tokenizer: Any, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenizes ``text`` without adding special tokens.

    Returns (ids int32 [n], starts int32 [n], ends int32 [n]): each token's character span
    ``text[start:end]``. Raises MaskError for a tokenizer that cannot report offsets.
    """
    backend = backend_of(tokenizer)
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
    # UTF-8 byte offset -> index of the character that byte belongs to; [len(bytes) + 1], the last
    # entry len(text). Continuation bytes are 0b10xxxxxx.
    if text.isascii():
        return np.arange(len(text) + 1, dtype=np.int32)
    utf8 = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return np.append(np.cumsum((utf8 & 0xC0) != 0x80, dtype=np.int32) - 1, np.int32(len(text)))


def check_tokenizer(tokenizer: Any, chat_format: Any) -> None:
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


def encode(segments: Sequence[Segment], trained: np.ndarray, tokenizer: Any) -> Example:
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


def encode_batch(items: Sequence[tuple[Sequence[Segment], np.ndarray]], tokenizer: Any,
                 add_special_tokens: bool = False, tokenized: tuple | None = None) -> list[Example]:
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


def text_of(segments: Sequence[Segment]) -> str:
    """The rendered text: the segments' texts joined."""
    return "".join(s.text for s in segments)


def tokenize_batch(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool = False,
                   lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokenizes ``texts`` (b strings) in one call.

    lengths: ``piece_lengths(tokenizer)``, to take token ids from the tokenizer's offset-free batch
    call and compute the spans from them (exact; a text where they cannot be is tokenized again with
    offsets); None asks the tokenizer for offsets. Not used with ``add_special_tokens``.
    Returns (counts int64 [b], ids int32 [n], starts int64 [n], ends int64 [n]): the number of
    tokens of each text, then every token of the batch, text after text, with its character span
    in its own text. A fast tokenizer's batch call runs on all cores without holding the GIL.
    """
    if not texts:
        return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    backend = backend_of(tokenizer)
    if lengths is not None and not add_special_tokens:
        return _spans_from_lengths(tokenizer, backend, texts, lengths)
    if hasattr(backend, "encode_batch"):
        encodings = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        counts, ids = _ids(encodings)
        chain = itertools.chain.from_iterable
        spans = np.fromiter(chain(chain(e.offsets for e in encodings)), dtype=np.int64, count=2 * len(ids))
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


def _ids(encodings):
    counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    ids = itertools.chain.from_iterable(e.ids for e in encodings)
    return counts, np.fromiter(ids, dtype=np.int32, count=int(counts.sum()))


_SPLITTERS = ("Split", "Punctuation", "Digits")  # they keep every character, unless "Removed"
_OFFSET_KEEPING = ("TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel")  # unless trim_offsets
_BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]  # byte-fallback pieces: one byte each


def piece_lengths(tokenizer: Any) -> np.ndarray | None:
    """Per token id, a lower bound on the UTF-8 bytes of text that a token stands for; int64 [vocab].

    Returns None unless ``tokenizer`` is a fast tokenizer whose pipeline never adds text and whose
    pieces spell their text: no normalizer, or Replace(" " -> one character), Gemma's ``▁``, which
    counts one byte; pre-tokenizers that only split, or a byte-level one (a piece character is one
    byte) without a prefix space; a BPE (no subword prefix or suffix; a byte-fallback piece
    ``<0xNN>`` is one byte) or word-level model; no post-processor that trims offsets.
    The bound is exact but for text the table cannot know (an unknown token counts 0 bytes, a
    literal ``▁`` 1, an added token that strips spaces only its content), so a text's token spans
    follow from its ids exactly when their lengths add up to the text's byte length.
    """
    backend = backend_of(tokenizer)
    if not hasattr(backend, "encode_batch_fast"):
        return None
    marker, byte_level = None, False
    for step in _steps(backend.normalizer, "normalizers"):
        if step["type"] != "Replace" or step["pattern"] != {"String": " "} or len(step["content"]) != 1:
            return None
        marker = step["content"]
    for step in _steps(backend.pre_tokenizer, "pretokenizers"):
        if step["type"] == "ByteLevel" and not step["add_prefix_space"]:
            byte_level = True
        elif step["type"] not in _SPLITTERS or step.get("behavior") == "Removed":
            return None
    for step in _steps(backend.post_processor, "processors"):
        if step["type"] not in _OFFSET_KEEPING or step.get("trim_offsets"):
            return None
    model = backend.model
    kind = type(model).__name__
    if (byte_level and marker) or kind not in ("BPE", "WordLevel"):
        return None
    if kind == "BPE" and (model.continuing_subword_prefix or model.end_of_word_suffix):
        return None
    shrink = len(marker.encode("utf-8")) - 1 if marker else 0

    def text_length(text):
        # A marker in the tokenizer's text stands for a space (1 byte), or for itself if the input had it.
        return len(text.encode("utf-8")) - (shrink * text.count(marker) if shrink else 0)

    vocab = backend.get_vocab(with_added_tokens=False)
    added = backend.get_added_tokens_decoder()
    table = np.zeros(max([*vocab.values(), *added, -1]) + 1, dtype=np.int64)
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    table[ids] = np.fromiter(map(len if byte_level else text_length, vocab), dtype=np.int64, count=len(vocab))
    if kind == "BPE" and model.byte_fallback:
        table[[i for i in map(vocab.get, _BYTE_PIECES) if i is not None]] = 1
    in_vocab = np.zeros(len(table), dtype=bool)
    in_vocab[ids] = True
    for i, token in added.items():
        # Matched before normalization (unless ``normalized``) and pre-tokenization: its content is text.
        size = text_length(token.content) if token.normalized else len(token.content.encode("utf-8"))
        table[i] = min(table[i], size) if in_vocab[i] else size
    if model.unk_token in vocab:
        table[vocab[model.unk_token]] = 0
    return table


def _steps(component, key):
    # A normalizer, pre-tokenizer or post-processor as a flat list of its steps' settings.
    if component is None:
        return []
    state = json.loads(component.__getstate__())
    pending, steps = [state], []
    while pending:
        step = pending.pop(0)
        if step["type"] == "Sequence":
            pending[:0] = step[key]
        else:
            steps.append(step)
    return steps


def _spans_from_lengths(tokenizer, backend, texts, lengths):
    counts, ids = _ids(backend.encode_batch_fast(texts, add_special_tokens=False))
    sizes = lengths[ids]
    joined = "".join(texts)
    ascii_ = joined.isascii()
    text_bytes = np.array([len(t) if ascii_ else len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    ends = np.cumsum(sizes)
    # Byte offsets within each text: the running sum restarts at every text's first token.
    before = np.append(0, ends)[np.cumsum(counts) - counts]
    ends -= np.repeat(before, counts)
    # Tokens cover disjoint bytes and each length is at most its token's bytes: the lengths add up to the
    # text's bytes only if every one is exact and no byte is left out.
    exact = np.append(ends, 0)[np.cumsum(counts) - 1] == text_bytes
    starts = ends - sizes
    if not ascii_:
        # Byte spans -> character spans in the joined text: a token that ends inside a character
        # (a byte piece) spans that whole character, as the tokenizer's own offsets do.
        char_of = _char_of_byte(joined)
        base = np.repeat(np.cumsum(text_bytes) - text_bytes, counts)
        chars = np.array([len(t) for t in texts], dtype=np.int64)
        char_base = np.repeat(np.cumsum(chars) - chars, counts)
        top = len(char_of) - 1
        starts = char_of[np.clip(starts + base, 0, top)] - char_base
        ends = char_of[np.clip(ends + base - 1, 0, top)] + 1 - char_base
    if exact.all():
        return counts, ids, starts, ends
    redo = np.flatnonzero(~exact)
    again = tokenize_batch(tokenizer, [texts[i] for i in redo])
    # The texts tokenized again take their tokens' places: order every token by its text.
    keep = np.repeat(exact, counts)
    text_of_token = np.concatenate([np.repeat(np.arange(len(texts)), counts)[keep], np.repeat(redo, again[0])])
    order = np.argsort(text_of_token, kind="stable")
    counts = counts.copy()
    counts[redo] = again[0]
    merged = (np.concatenate([a[keep], b])[order] for a, b in zip((ids, starts, ends), again[1:]))
    return counts, *merged
