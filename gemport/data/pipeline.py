"""From conversations to fitted, masked examples."""

import itertools
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.policies import MaskPolicy
from gemport.data.render import Segment
from gemport.data.tokenize import Example, check_tokenizer, encode, encode_batch, piece_lengths, text_of, tokenize_batch
from gemport.data.truncation import Fitted, Truncation, TruncationReport, truncate


class Rendered(NamedTuple):
    """One record ready to tokenize: its ``key`` for the report, its ``Segment``s and which are
    trained (bool [len(segments)]), and whether it is plain text (tokenized with the tokenizer's
    own special tokens, every token a boundary truncation may cut at)."""

    key: Hashable
    segments: tuple[Segment, ...]
    trained: np.ndarray | Sequence[bool]
    plain: bool = False


def prepare(messages: Sequence[Mapping[str, Any]], tokenizer: Any, chat_format: Gemma3 | Gemma4,
            policy: MaskPolicy, truncation: Truncation) -> Fitted:
    """Renders, masks and truncates one conversation (the tokenizer is not checked: see ``build``).

    Returns ``truncate``'s ``Fitted`` (example or None, decision, targets_lost).
    """
    segments = chat_format.render(messages)
    return truncate(encode(segments, policy.select(segments), tokenizer), truncation)


def build(conversations: Iterable[Sequence[Mapping[str, Any]]], tokenizer: Any, chat_format: Gemma3 | Gemma4,
          policy: MaskPolicy, truncation: Truncation, *, batch_size: int = 512,
          progress: bool = True) -> tuple[list[Example], TruncationReport]:
    """Renders, masks and truncates every conversation.

    conversations: iterable of message lists; chat_format: ``Gemma3()`` or ``Gemma4(...)``;
    policy: ``MaskPolicy``; truncation: ``Truncation``. Checks the tokenizer once first, then
    tokenizes ``batch_size`` conversations per call (a progress bar counts them unless
    ``progress`` is False). Returns (examples, report): the kept ``Example``s in input order (each
    of at most ``truncation.max_len`` tokens, each with at least one target) and the
    ``TruncationReport``, which names conversations by their index in ``conversations``.
    """
    check_tokenizer(tokenizer, chat_format)

    def rendered():
        for index, messages in enumerate(conversations):
            segments = chat_format.render(messages)
            yield Rendered(index, segments, policy.select(segments))

    total = _length(conversations)
    return fit(rendered(), tokenizer, truncation, batch_size=batch_size, progress=progress, total=total)


def fit(rendered: Iterable[Rendered], tokenizer: Any, truncation: Truncation, *, batch_size: int = 512,
        progress: bool = True, total: int | None = None) -> tuple[list[Example], TruncationReport]:
    """Tokenizes, labels and truncates ``Rendered`` records, ``batch_size`` per tokenizer call.

    Returns (examples, report) as ``build`` does, the report naming records by their keys.
    Token spans come from each token's length when the tokenizer allows (see ``piece_lengths``),
    which spares the tokenizer reporting offsets.
    """
    report = TruncationReport()
    lengths = piece_lengths(tokenizer)
    examples = []
    rendered = iter(rendered)

    def label(batch, tokenized):
        for r, (example, decision, lost) in zip(batch, fit_batch(batch, tokenizer, truncation, tokenized.result())):
            report.record(decision, lost, r.key)
            if example is not None:
                examples.append(example)
        bar.update(len(batch))

    with tqdm(total=total, desc="masks", unit="example", disable=not progress, leave=False) as bar:
        with ThreadPoolExecutor(1) as pool:
            queued = None
            while batch := list(itertools.islice(rendered, batch_size)):
                # The tokenizer works on this batch (native code, no GIL) while Python labels the one before.
                job = (batch, pool.submit(_tokenize, batch, tokenizer, lengths))
                if queued:
                    label(*queued)
                queued = job
            if queued:
                label(*queued)
    return examples, report


def _tokenize(batch, tokenizer, lengths):
    texts = {plain: [text_of(r.segments) for r in batch if r.plain == plain] for plain in (False, True)}
    return {plain: tokenize_batch(tokenizer, texts[plain], plain, lengths) for plain in (False, True)}


def fit_batch(batch: Sequence[Rendered], tokenizer: Any, truncation: Truncation,
              tokenized: Mapping[bool, Any] | None = None) -> list[Fitted]:
    """``truncate``'s ``Fitted`` for each ``Rendered`` of ``batch``: one tokenizer call for the
    conversations of the batch and one for its plain texts (``tokenized``: those two calls' results by
    plainness, when made elsewhere)."""
    fitted = [None] * len(batch)
    for plain in (False, True):
        chosen = [i for i, r in enumerate(batch) if r.plain == plain]
        items = [(batch[i].segments, batch[i].trained) for i in chosen]
        done = tokenized[plain] if tokenized else None
        for i, example in zip(chosen, encode_batch(items, tokenizer, add_special_tokens=plain, tokenized=done)):
            if plain:
                # Plain text has no turns to protect: truncation may cut after any token.
                example = example._replace(turn_ids=np.arange(len(example.tokens), dtype=np.int32))
            fitted[i] = truncate(example, truncation)
    return fitted


def _length(source):
    try:
        return len(source)
    except TypeError:
        return None
