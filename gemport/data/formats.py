"""TRL's SFT dataset formats as masked examples, from the files and datasets they come in.

TRL's ``SFTTrainer`` reads three kinds of record, and so does `gemport.data.dataset.examples`:

- conversational language modelling: ``{"messages": [...]}`` (or ShareGPT-style
  ``{"conversations": [{"from", "value"}]}``), optional ``"tools"`` (a list, or its JSON text);
- prompt/completion, conversational (two message lists) or standard (two strings);
- plain text: ``{"text": str}`` (the field is ``text_field``, TRL's ``dataset_text_field``).

Masks follow TRL's: ``policy`` plays ``assistant_only_loss`` (None trains every token, as TRL does
without it), ``completion_only_loss`` trains only what follows the prompt, and the standard
formats get the tokenizer's EOS appended and its own special tokens, as TRL tokenizes them.
"""

import dataclasses
import itertools
import json
import os
import typing
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from gemport.errors import MaskError
from gemport._src.extras import require
from gemport.data.pipeline import Rendered
from gemport.data.policies import MaskPolicy
from gemport.data.render import Segment
from gemport.data.tokenize import text_of
from gemport._src.options import one_of

if TYPE_CHECKING:
    from gemport.data.gemma3 import Gemma3
    from gemport.data.gemma4 import Gemma4

Format = Literal["messages", "prompt_completion", "text"]
"""A record format, as ``detect`` names it."""
FORMATS: tuple[Format, ...] = typing.get_args(Format)
"""Record formats, as ``detect`` names them."""

_ALL_TOKENS = MaskPolicy("all_tokens")


def read(source: Any, batch_size: int = 1024) -> Iterator[Any]:
    """Yields the records (dicts) of ``source``, lazily.

    source: a path (str or os.PathLike) to a ``.jsonl`` file (one JSON object a line), a ``.json``
        file (a list of objects) or a ``.parquet`` file (read ``batch_size`` rows at a time); or a
        ``datasets.Dataset`` / ``IterableDataset``, a Grain ``MapDataset`` or data source, or any
        sequence or iterable of dicts.
    """
    for _, record in located(source, batch_size):
        yield record


def located(source: Any, batch_size: int = 1024) -> Iterator[tuple[str, Any]]:
    """Yields ``(where, record)`` for the records of ``source`` (as ``read`` takes it), lazily: ``where`` names
    the record for a user to find it: ``path:line`` in a .jsonl file, ``path[index]`` in a .json or .parquet
    file, ``record index`` (from 0) in a dataset or list."""
    if isinstance(source, (str, os.PathLike)):
        yield from _read_file(os.fspath(source), batch_size)
    elif isinstance(source, Mapping):
        raise MaskError("source: a dict; pass a list of records (or a file, dataset or Grain source)")
    elif hasattr(source, "__iter__"):
        for i, record in enumerate(source):
            yield f"record {i}", record
    else:
        # A Grain data source (RandomAccessDataSource) is read by index.
        for i in range(len(source)):
            yield f"record {i}", source[i]


class Lines(NamedTuple):
    """Consecutive records of a .jsonl file as the raw lines read here, parsed where they are read (``read``).

    first: the dataset index of the first; lines: (where, line) pairs, ``where`` as ``located`` names them."""

    first: int
    lines: tuple[tuple[str, bytes], ...]

    @property
    def count(self) -> int:
        """The records of this part."""
        return len(self.lines)

    def read(self, source: Any) -> Iterator[tuple[str, Any]]:
        """``located``'s (where, record) pairs of these lines."""
        for where, line in self.lines:
            yield where, _json(line, where)


class Records(NamedTuple):
    """Consecutive records read here (a .json or .parquet file, an iterable): first, the dataset index of the
    first; records, ``located``'s (where, record) pairs."""

    first: int
    records: tuple[tuple[str, Any], ...]

    @property
    def count(self) -> int:
        """The records of this part."""
        return len(self.records)

    def read(self, source: Any) -> Iterator[tuple[str, Any]]:
        """``located``'s (where, record) pairs of these records."""
        return iter(self.records)


class Span(NamedTuple):
    """Records ``first`` to ``first + count`` of a source that can be indexed (a list, a ``datasets.Dataset``, a
    Grain source), read from it where the part is read (a forked process holds the same source)."""

    first: int
    count: int

    def read(self, source: Any) -> Iterator[tuple[str, Any]]:
        """``located``'s (where, record) pairs of these records of ``source``."""
        stop = self.first + self.count
        if hasattr(source, "column_names"):  # a datasets.Dataset: one slice of columns, far faster than rows
            columns = source[self.first:stop]
            rows = (dict(zip(columns, values)) for values in zip(*columns.values()))
        else:
            rows = (source[i] for i in range(self.first, stop))
        for i, record in enumerate(rows, self.first):
            yield f"record {i}", record


Part = Lines | Records | Span
"""Consecutive records of a source, to be read in another process (``part.read(source)``): ``parts`` cuts them."""


def parts(source: Any, size: int) -> Iterator[Part]:
    """The records of ``source`` (as ``read`` takes it) as consecutive ``Part``s of up to ``size`` records, lazily.

    A .jsonl file's lines are read here and parsed where each part is read; a source that can be indexed (a list, a
    ``datasets.Dataset``, a Grain source) is cut into ``Span``s read from it there; anything else is read here.
    """
    if isinstance(source, (str, os.PathLike)) and os.path.splitext(os.fspath(source))[1].lower() in (".jsonl",
                                                                                                     ".ndjson"):
        path = os.fspath(source)
        first, batch = 0, []
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    batch.append((f"{path}:{line_number}", line))
                    if len(batch) == size:
                        yield Lines(first, tuple(batch))
                        first, batch = first + size, []
        if batch:
            yield Lines(first, tuple(batch))
    elif _indexable(source):
        for first in range(0, len(source), size):
            yield Span(first, min(size, len(source) - first))
    else:
        records = located(source)
        first = 0
        while batch := tuple(itertools.islice(records, size)):
            yield Records(first, batch)
            first += len(batch)


def _indexable(source: Any) -> bool:
    return (hasattr(source, "__len__") and hasattr(source, "__getitem__")
            and not isinstance(source, (str, bytes, os.PathLike, Mapping)))


def _read_file(path, batch_size):
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        pq = require("pyarrow.parquet", f"{path}: reading Parquet")
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
            for record in batch.to_pylist():
                yield f"{path}[{row}]", record
                row += 1
    elif suffix in (".jsonl", ".ndjson"):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    where = f"{path}:{line_number}"
                    yield where, _json(line, where)
    elif suffix == ".json":
        with open(path, encoding="utf-8") as f:
            records = _json(f.read(), path)
        if not isinstance(records, list):
            raise MaskError(f"{path}: expected a JSON list of records; for one record a line, name it .jsonl")
        for i, record in enumerate(records):
            yield f"{path}[{i}]", record
    else:
        raise MaskError(f"{path}: unknown data file type {suffix!r}; use .jsonl, .json or .parquet")


def _json(text, where):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise MaskError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error


def detect(record: Any, text_field: str = "text") -> Format:
    """The format of one record, by its keys as TRL tells them apart: one of ``FORMATS``."""
    if not isinstance(record, Mapping):
        raise MaskError(f"record: expected a dict, got {type(record).__name__}")
    if "messages" in record or "conversations" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if text_field in record:
        return "text"
    pairs = ("; 'chosen'/'rejected' make a preference pair, which `gemport dpo` and `gemport parity --trainer dpo` "
             "take" if "chosen" in record and "rejected" in record else "")
    raise MaskError(
        f"record: keys {sorted(record)} match no SFT format; expected 'messages', 'prompt' and "
        f"'completion', or {text_field!r} (text_field){pairs}"
    )


def render(record: Mapping[str, Any], chat_format: "Gemma3 | Gemma4 | None", *, policy: MaskPolicy | None = None,
           fmt: Format | None = None, completion_only_loss: bool | None = None, text_field: str = "text",
           eos_token: str | None = None, key: Hashable | None = None) -> Rendered:
    """Renders one record and marks what is trained, as TRL's ``SFTTrainer`` would; returns ``Rendered``.

    chat_format: ``Gemma3()`` / ``Gemma4(...)``; None for a tokenizer without a chat template, which renders
        text and prompt/completion strings (as TRL, without one) and refuses conversations with MaskError.

    policy: ``MaskPolicy`` for conversations; None trains every token (TRL without
        ``assistant_only_loss``; ``MaskPolicy("assistant")`` is TRL with it).
    fmt: one of ``FORMATS``, or None to ``detect`` it per record.
    completion_only_loss: for prompt/completion records, train only what follows the prompt (None:
        True, TRL's default). In a conversation the prompt ends with the generation prompt, so the
        completion's ``<|turn>model`` header is not trained.
    eos_token: appended to standard completions and texts that do not end with it (TRL's rule);
        required for those formats.
    A record's ``"chat_template_kwargs"`` (which TRL passes to the template) may set
    ``enable_thinking`` (Gemma 4), which turns thinking on or off for that record (``for_record``).
    """
    fmt = one_of(fmt or detect(record, text_field), Format, "fmt", MaskError)
    policy = policy or _ALL_TOKENS
    if chat_format is None and conversational(record, fmt):
        raise MaskError(f"record {key if key is not None else ''}: a conversation ({fmt}) is rendered by a chat "
                        "template and the tokenizer has none; set chat_template_path, or give text or "
                        "prompt/completion strings, which TRL tokenizes without one")
    chat_format = for_record(chat_format, record) if chat_format is not None else None
    tools = record_tools(record.get("tools"))
    if fmt == "messages":
        segments = chat_format.render(_messages(record), tools)
        return Rendered(key, segments, policy.select(segments))
    if fmt == "text":
        text = _string(record.get(text_field), f"record[{text_field!r}]")
        return Rendered(key, (Segment(_with_eos(text, eos_token), "", "content", 0),), [True], plain=True)
    prompt, completion = record["prompt"], record["completion"]
    only = True if completion_only_loss is None else completion_only_loss
    if isinstance(prompt, str) or isinstance(completion, str):
        prompt = _string(prompt, "record['prompt']")
        completion = _with_eos(_string(completion, "record['completion']"), eos_token)
        segments = (Segment(prompt, "user", "content", 0), Segment(completion, "assistant", "content", 1))
        return Rendered(key, segments, [not only, True], plain=True)
    prompt, completion = _message_list(prompt, "prompt"), _message_list(completion, "completion")
    segments = chat_format.render(prompt + completion, tools)
    trained = policy.select(segments)
    if not only:
        return Rendered(key, segments, trained)
    # TRL trains from where the prompt, rendered with its generation prompt, stops matching the whole.
    head = text_of(chat_format.render(prompt, tools, add_generation_prompt=True))
    boundary = len(os.path.commonprefix([head, text_of(segments)]))
    return Rendered(key, *_after(segments, trained, boundary))


def conversation(record: Mapping[str, Any]) -> tuple[list[Any], Any]:
    """(messages, tools) of a conversational record, as the chat template receives them: the
    prompt and completion joined for prompt/completion records; tools parsed from JSON text."""
    if "prompt" in record and "messages" not in record and "conversations" not in record:
        messages = _message_list(record["prompt"], "prompt") + _message_list(record["completion"], "completion")
    else:
        messages = _messages(record)
    return messages, record_tools(record.get("tools"))


def for_record(chat_format: "Gemma3 | Gemma4", record: Any) -> "Gemma3 | Gemma4":
    """``chat_format`` as ``record`` asks for it: its ``"chat_template_kwargs"`` may set ``enable_thinking``
    (Gemma 4: True renders ``thinking="on"``; False turns ``"on"`` off and keeps ``"off"`` or
    ``"empty_thought"``); any other key raises MaskError, since gemport would silently render without it."""
    kwargs = record.get("chat_template_kwargs")
    if not kwargs:
        return chat_format
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown or not hasattr(chat_format, "enable_thinking"):
        raise MaskError(
            f"record['chat_template_kwargs']: {unknown or sorted(kwargs)} not rendered by {chat_format!r}; "
            "gemport follows enable_thinking (Gemma 4) only"
        )
    if kwargs["enable_thinking"]:
        return dataclasses.replace(chat_format, thinking="on")
    return dataclasses.replace(chat_format, thinking="off") if chat_format.enable_thinking else chat_format


def conversational(record: Any, fmt: Format) -> bool:
    """Whether a record of format ``fmt`` is a conversation (what a chat template renders)."""
    return fmt == "messages" or (fmt == "prompt_completion" and not isinstance(record["prompt"], str))


def _messages(record):
    if "messages" in record:
        messages = _message_list(record["messages"], "messages")
        if not messages:
            raise MaskError("record['messages']: an empty conversation; drop the record or give its turns")
        return messages
    # ShareGPT's {"from", "value"} keys, renamed as TRL's maybe_convert_to_chatml does (roles are kept).
    rename = {"from": "role", "value": "content"}
    return [
        {rename.get(k, k): v for k, v in m.items()} if isinstance(m, Mapping) else m
        for m in _message_list(record["conversations"], "conversations")
    ]


def _message_list(value, field):
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise MaskError(f"record[{field!r}]: expected a list of messages, got {type(value).__name__}")
    return list(value)


def record_tools(tools):
    """A record's ``tools`` as a list of tool schemas: TRL reads a "tools" column that holds JSON text (Arrow cannot
    hold free-form schemas) or a list; None stays None."""
    if isinstance(tools, str):
        return _json(tools, "record['tools']")
    return tools


def _string(value, where):
    if not isinstance(value, str):
        raise MaskError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _with_eos(text, eos_token):
    if eos_token is None:
        raise MaskError("eos_token: None; the standard formats append it (pass eos_token= or a tokenizer that has one)")
    return text if text.endswith(eos_token) else text + eos_token


def _after(segments, trained, boundary):
    # Segments and flags with nothing before character `boundary` trained; the segment it falls in is split.
    out, flags, start = [], [], 0
    for segment, flag in zip(segments, trained):
        end = start + len(segment.text)
        if start < boundary < end:
            cut = boundary - start
            out += [segment._replace(text=segment.text[:cut]), segment._replace(text=segment.text[cut:])]
            flags += [False, bool(flag)]
        else:
            out.append(segment)
            flags.append(bool(flag) and start >= boundary)
        start = end
    return tuple(out), flags

