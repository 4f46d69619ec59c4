"""Every token id the data produces, checked once against the model's embedding before the first step.

A tokenizer with tokens the model's embedding lacks (special tokens added to the tokenizer, the embedding not
resized) gives ids past its last row. torch's embedding raises on them; JAX's gather clamps them to the last row,
so they would train silently as another token. ``check_token_ids`` refuses them, in one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gemport.errors import MaskError
from gemport.data.flat import FlatExamples
from gemport.data.tokenize import Example


def check_token_ids(examples: Sequence[Example] | FlatExamples, vocab: int, tokenizer: Any, *, pad_id: int | None = None,
                    split: str = "train") -> None:
    """Raise MaskError unless every id of ``examples`` (and ``pad_id``) is a row of a [vocab, D] embedding.

    Args:
      examples: the tokenized examples (``Example.tokens`` int [n] each), as laid out into batches.
      vocab: the model's vocabulary size V (``GemmaSpec.vocab``).
      tokenizer: names the offending token and gives its own size.
      pad_id: the id padding fills rows with; checked too.
      split: names the examples in the message ("train", "eval").

    Raises:
      MaskError: names the first offending example (its index among the kept ``split`` examples), the id,
        its token, how many distinct ids are out of range, and both sizes.
    """
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else "?"
    fix = ("resize the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)), then "
           "save it) or use the checkpoint's own tokenizer")
    if pad_id is not None and not 0 <= pad_id < vocab:
        raise MaskError(f"tokenizer: the pad id {pad_id} ({_token(tokenizer, pad_id)!r}) is not below the model's "
                        f"vocab_size {vocab} (the tokenizer has {size} tokens); set pad_token to a token of the "
                        f"model, or {fix}")
    if not len(examples):
        return
    if isinstance(examples, FlatExamples):  # prepared: its id range says it all, read only to name the culprit
        low, high = examples.id_range
        if 0 <= low and high < vocab:
            return
        ids, ends = np.asarray(examples.tokens), examples.offsets[1:]
    else:
        ids = np.concatenate([np.asarray(e.tokens) for e in examples])
        ends = np.cumsum([len(e.tokens) for e in examples])
    bad = (ids < 0) | (ids >= vocab)
    if not bad.any():
        return
    first = int(np.argmax(bad))
    example = int(np.searchsorted(ends, first, side="right"))
    token_id = int(ids[first])
    distinct = np.unique(ids[bad])
    raise MaskError(
        f"{split} example {example}: token id {token_id} ({_token(tokenizer, token_id)!r}) is not below the model's "
        f"vocab_size {vocab}; the tokenizer has {size} tokens ({len(distinct)} distinct ids of the data are past "
        f"the embedding: {distinct[:8].tolist()}{' ...' if len(distinct) > 8 else ''}). JAX would clamp them to "
        f"the last row and train them as that token; {fix}")


def _token(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # a tokenizer that cannot name it: the id says enough
        return "?"


__all__ = ["check_token_ids"]
