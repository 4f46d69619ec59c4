"""Preference records as TRL 1.16's ``DPOTrainer`` takes them: prompt extraction, EOS, tokens, truncation, padding.

TRL's rule, reproduced here: a record holds ``prompt``/``chosen``/``rejected`` (explicit prompt) or only
``chosen``/``rejected`` (implicit prompt: their shared beginning is the prompt), as plain strings or as lists of
chat messages. Plain completions get the tokenizer's EOS appended where they lack it. The prompt is tokenized
alone (a conversation with its generation prompt), and so is the prompt followed by each completion; the
completion starts where those token ids first differ (a merge across the boundary, or a template that renders
a lone prompt differently, moves it). Each pair is truncated per sequence (``max_length``, ``truncation_mode``)
when it is batched, and a pair whose prompt alone fills ``max_length`` is dropped under ``keep_start``.
Conversations are rendered by gemport's chat formats (``data.Gemma3`` / ``data.Gemma4``, the SFT path's),
not by the tokenizer's Jinja template; ``data.template.check_template`` tells whether the two agree.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from gemport.errors import MaskError, RecipeError
from gemport.data.batching import pad
from gemport.data.formats import for_record, record_tools
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.packing import Rows
from gemport.data.tokenize import text_of
from gemport.data.template import chat_format as from_tokenizer

TruncationMode = Literal["keep_start", "keep_end"]


class Preference(NamedTuple):
    """One tokenized preference pair: int32 ``prompt_ids`` [p], ``chosen_ids`` [c], ``rejected_ids`` [r]
    (TRL's columns of the same names)."""

    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray


def _conversational(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping)


def _check(record: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise MaskError(f"{where}: expected a dict, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise MaskError(f"{where}: no {missing} key; a preference record has 'chosen' and 'rejected' "
                        "(and 'prompt' unless it is their shared beginning)")
    for key in ("prompt", "chosen", "rejected"):
        if key in record and not isinstance(record[key], (str, list)):
            raise MaskError(f"{where}[{key!r}]: expected a string or a list of messages, "
                            f"got {type(record[key]).__name__}")
    return record


def split_prompt(chosen: str | list, rejected: str | list) -> tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``: (prompt, chosen, rejected) from two completions that share a beginning.

    The prompt is their longest common prefix of characters (strings) or messages (conversations), less a
    trailing space; as in TRL, when one completion is a prefix of the other the split falls one item before
    the shorter one ends.
    """
    n = min(len(chosen), len(rejected))
    idx = n - 1  # TRL's loop variable where no item differs
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenize(record: Mapping[str, Any], tokenizer: Any, chat_format: Gemma3 | Gemma4 | None = None, *,
             eos_token: str | None = None, where: str = "record") -> Preference:
    """One preference record to a ``Preference``, as TRL's ``DPOTrainer`` prepares it.

    record: {"prompt"?, "chosen", "rejected"} as strings or lists of messages (with optional ``tools`` and
        ``chat_template_kwargs``, as the SFT path reads them).
    tokenizer: a transformers tokenizer; plain text is tokenized as TRL does (``tokenizer(text)``, special
        tokens included), a rendered conversation without adding any (its ``<bos>`` is in the text).
    chat_format: renders conversations (``data.template.chat_format(tokenizer)`` when None and needed).
    eos_token: appended to plain completions lacking it (default ``tokenizer.eos_token``).
    Returns int32 arrays; raises MaskError naming the record for a malformed one.
    """
    record = _check(record, where)
    if "prompt" in record:
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    else:
        prompt, chosen, rejected = split_prompt(record["chosen"], record["rejected"])
    if _conversational(chosen) or _conversational(prompt):
        if chat_format is None:
            chat_format = from_tokenizer(tokenizer)
        chat_format = for_record(chat_format, record)
        tools = record_tools(record.get("tools"))

        def render(messages, generation_prompt=False):
            try:
                return _ids(tokenizer, text_of(chat_format.render(messages, tools, generation_prompt)), False)
            except MaskError as e:
                raise MaskError(f"{where}: {e}") from None

        prompt_ids = render(list(prompt), True)
        chosen_full, rejected_full = render(list(prompt) + list(chosen)), render(list(prompt) + list(rejected))
    else:
        eos = eos_token if eos_token is not None else getattr(tokenizer, "eos_token", None)
        if eos is None:
            raise MaskError(f"{where}: the tokenizer has no eos_token to end plain completions; pass eos_token=")
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = _ids(tokenizer, prompt, True)
        chosen_full, rejected_full = _ids(tokenizer, prompt + chosen, True), _ids(tokenizer, prompt + rejected, True)
    shared = min(_common(prompt_ids, chosen_full), _common(prompt_ids, rejected_full))
    as_array = lambda ids: np.asarray(ids, np.int32)  # noqa: E731
    return Preference(as_array(prompt_ids[:shared]), as_array(chosen_full[shared:]), as_array(rejected_full[shared:]))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def preferences(records: Iterable[Mapping[str, Any]], tokenizer: Any, chat_format: Gemma3 | Gemma4 | None = None,
                *, max_length: int | None = 1024, truncation_mode: TruncationMode = "keep_start",
                eos_token: str | None = None) -> list[Preference]:
    """Every record ``tokenize``d, less those TRL drops: with ``keep_start`` truncation, a pair whose prompt
    alone has ``max_length`` tokens or more (nothing of its completions would be left). Order is kept."""
    _check_truncation(max_length, truncation_mode)
    out = []
    for i, record in enumerate(records):
        p = tokenize(record, tokenizer, chat_format, eos_token=eos_token, where=f"records[{i}]")
        if max_length is None or truncation_mode != "keep_start" or len(p.prompt_ids) < max_length:
            out.append(p)
    return out


def _check_truncation(max_length, truncation_mode):
    if truncation_mode not in ("keep_start", "keep_end"):
        raise RecipeError(f"DPOConfig.truncation_mode={truncation_mode!r}: expected 'keep_start' or 'keep_end'")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 1):
        raise RecipeError(f"DPOConfig.max_length={max_length!r}: expected a positive int or None")


def collate(pairs: Sequence[Preference], *, max_length: int | None = 1024,
            truncation_mode: TruncationMode = "keep_start", pad_to_multiple_of: int | None = None,
            width: int | None = None, slots: int | None = None, pad_id: int = 0) -> Rows:
    """One micro-batch of pairs as TRL's ``DataCollatorForPreference`` lays it out, as ``data.Rows``.

    Rows 0..n-1 are prompt + chosen, rows n..2n-1 prompt + rejected, each truncated alone (``keep_start``:
    its first ``max_length`` tokens; ``keep_end``: its last), right-padded to the longest row (or to
    ``width``, for a fixed shape), rounded up to ``pad_to_multiple_of``. ``loss_mask`` is TRL's
    ``completion_mask`` (token t of a completion is a target, predicted from t - 1); ``segment_ids`` is
    its ``attention_mask``. slots: pairs per half, at least n (default n): the missing ones are rows of padding
    at the end of each half, which ``dpo_loss`` leaves out, so a short last micro-batch keeps the step's shape
    (``step.hf.stack`` pads whole micro-batches only: its padding rows would join the rejected half).
    Returns ``Rows`` [2 * slots, T].
    """
    _check_truncation(max_length, truncation_mode)
    if not pairs:
        raise MaskError("collate: no pair")
    cut = slice(None) if max_length is None else (
        slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None))
    rows = []
    for side in ("chosen_ids", "rejected_ids"):
        for p in pairs:
            completion = getattr(p, side)
            tokens = np.concatenate([p.prompt_ids, completion]).astype(np.int32)
            mask = np.concatenate([np.zeros(len(p.prompt_ids), bool), np.ones(len(completion), bool)])
            rows.append((tokens[cut], mask[cut]))
    out = pad(rows, width, pad_to_multiple_of=pad_to_multiple_of, pad_id=pad_id)
    n = len(pairs)
    slots = n if slots is None else slots
    if slots < n:
        raise MaskError(f"collate: {n} pairs for slots={slots}")
    if slots == n:
        return out
    padded = {}
    for k, v in out.items():
        padded[k] = np.full((2 * slots, v.shape[1]), pad_id if k == "tokens" else 0, v.dtype)
        padded[k][:n], padded[k][slots:slots + n] = v[:n], v[n:]
    return Rows(**padded)
