"""Prepared examples written once and read by every later run, resume and host: ``prepared``.

A preparation (``gemport.data.prepared``) is keyed by everything that changes the examples: the data (a file's
content, a ``datasets.Dataset``'s fingerprint, a list's records), the tokenizer (its whole ``tokenizer.json``, its
special tokens and chat template), how records render and fit (``SFTPipeline``'s chat format, mask policy,
truncation, text field and EOS), the packing (``max_length`` and ``dataset_num_proc`` with ``packing``) and the
preparation's ``FORMAT``. It lives in ``<root>/<key>/``; a rerun with the same key reads it from disk as batches ask
and tokenizes nothing.

A data file is named by its content (sha256), read once: ``<root>/stamps/`` remembers the content hash of a path at
its size and modification time (in nanoseconds), so a rerun does not read the file again. Writing a file through
the filesystem changes its modification time; what keeps it (``cp -p``, ``rsync -t``, ``touch -d``) copies
another file's stamp with that file's content, so a stale stamp needs a different content of the same byte size
given the same nanosecond mtime. A stamp is only a shortcut to the content hash: copies of one file on other hosts
(other mtimes) hash to the same key.

A preparation is written in a temporary folder beside the key's and renamed into place once its manifest is
written: an interrupted one (Ctrl-C, a killed process) never looks complete, and two runs preparing the same key
at once both end with the one that renamed first.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from gemport.checkpoint.output import atomic_dir
from gemport.data import formats
from gemport.errors import CheckpointError
from gemport.data.dataset import Options, check_source
from gemport.data.prepared import FORMAT, Prepared, Writer, complete, load
from gemport.data.workers import Job, prepared_parts

if TYPE_CHECKING:
    from gemport.data.sft import SFTPipeline

STAMPS = "stamps"
"""The folder under a cache root that remembers data files' content hashes by path, size and mtime."""

_BLOCK = 1 << 24


def file_digest(path: str | os.PathLike, stamps: Path) -> str:
    """sha256 of a file's bytes, read once per (path, size, mtime_ns): remembered under ``stamps``."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    known = stamps / stamp
    if known.is_file():
        return known.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    stamps.mkdir(parents=True, exist_ok=True)
    tmp = stamps / f".{stamp}.{socket.gethostname()}.{os.getpid()}"
    tmp.write_text(h.hexdigest())
    os.replace(tmp, known)
    return h.hexdigest()


def data_fingerprint(source: Any, stamps: Path) -> str:
    """What names the records of ``source``: a file's content hash (``file_digest``), a ``datasets.Dataset``'s
    fingerprint (``datasets.fingerprint.generate_fingerprint``: its table, its indices and its files' mtimes, what
    ``datasets`` itself caches ``map`` results by), else sha256 of every record as JSON (read once here: give large
    data as a file or a ``datasets.Dataset``)."""
    if isinstance(source, (str, os.PathLike)):
        return f"file:{file_digest(source, stamps)}"
    if hasattr(source, "cache_files") and hasattr(source, "column_names"):
        from datasets.fingerprint import generate_fingerprint  # optional: datasets

        return f"datasets:{generate_fingerprint(source)}:{len(source)}"
    h = hashlib.sha256()
    for record in formats.read(source):
        h.update(json.dumps(record, sort_keys=True, default=repr).encode())
        h.update(b"\n")
    return f"records:{h.hexdigest()}"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what a tokenizer does to text: its whole ``tokenizer.json`` (vocabulary, merges, normalizer,
    pre-tokenizer, post-processor, added tokens; the vocabulary of a tokenizer without one), its special tokens
    and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256(body.encode())
    h.update(json.dumps([type(tokenizer).__name__, getattr(tokenizer, "special_tokens_map", {}),
                         getattr(tokenizer, "chat_template", None)], sort_keys=True, default=repr).encode())
    return h.hexdigest()


def about(pipeline: SFTPipeline, source: Any, tokenizer: Any, stamps: Path) -> dict[str, Any]:
    """Everything that changes the prepared examples of ``source``, as JSON (the key is its hash)."""
    packing = [pipeline.max_length, pipeline.num_proc] if pipeline.layout == "pack" else None
    return {"format": FORMAT, "data": data_fingerprint(source, stamps),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "render": [repr(pipeline.chat_format), repr(pipeline.policy), repr(pipeline.truncation),
                       pipeline.completion_only_loss, pipeline.text_field, _eos(pipeline, tokenizer)],
            "packing": packing}


def key_of(facts: Mapping[str, Any]) -> str:
    """The folder name of a preparation: the first 24 hex digits of sha256 of ``about``'s JSON."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def prepared(pipeline: SFTPipeline, source: Any, tokenizer: Any, *, root: str | os.PathLike, workers: int | None = None,
             check: str | None = "warn", template: Mapping[str, Any] | None = None,
             progress: bool = True) -> Prepared:
    """The examples of ``source`` as ``pipeline`` prepares them (with ``packing``, TRL's packed rows too), from
    ``<root>/<key>/`` when a run prepared them before, else prepared now on ``workers`` processes and written there.

    Args:
      pipeline: the recipe's ``SFTPipeline``.
      source: the records (``formats.read``'s sources: a file, a ``datasets.Dataset``, a list...).
      tokenizer: the fast tokenizer.
      root: the cache folder (``SFTRun``'s default: ``<output_dir>/gemport-data``).
      workers: processes preparing at once; default every core this process may run on.
      check: ``dataset.check_source``'s template check of the first records ("warn", "raise" or None).
      template: a custom chat template's check (``chat_template.check_records``' ``tokenizer``, ``chat_format``,
        ``policy``, ``text_field``), run on every record as it is prepared, or None.
      progress: a progress bar while preparing.

    Returns:
      The ``Prepared`` examples (read from disk as batches ask), their packed rows and truncation report.

    Raises:
      MaskError, RecipeError: a record the pipeline cannot render, a template it does not follow, an example
        packing cannot take; nothing is left in ``root`` then.
    """
    root = Path(root)
    facts = about(pipeline, source, tokenizer, root / STAMPS)
    path = root / key_of(facts)
    if not complete(path):
        _prepare(pipeline, source, tokenizer, path, facts, workers=workers or len(os.sched_getaffinity(0)),
                 check=check, template=template, progress=progress)
    return load(path)


def _eos(pipeline, tokenizer):
    return pipeline.eos_token if pipeline.eos_token is not None else getattr(tokenizer, "eos_token", None)


def _prepare(pipeline, source, tokenizer, path, facts, *, workers, check, template, progress):
    options = Options(pipeline.chat_format, policy=pipeline.policy, completion_only_loss=pipeline.completion_only_loss,
                      text_field=pipeline.text_field, eos_token=_eos(pipeline, tokenizer))
    check_source(formats.located(source), tokenizer, options, check=check)
    try:
        with atomic_dir(path) as tmp:  # renamed into place once the manifest is written; removed on any failure
            writer = Writer(tmp)
            job = Job(source, tokenizer, pipeline.truncation, options, dict(template) if template else None)
            total = len(source) if hasattr(source, "__len__") and not isinstance(source, (str, os.PathLike)) else None
            with tqdm(total=total, desc="prepare data", unit="record", disable=not progress) as bar:
                for done in prepared_parts(job, workers=workers):
                    writer.append(done.tokens, done.loss_mask, done.lengths, done.targets, done.report)
                    bar.update(done.records)
            writer.finish(pipeline.placement if pipeline.layout == "pack" else lambda examples: None, dict(facts))
    except CheckpointError:
        if not complete(path):  # not another run's complete preparation of the same key, renamed first
            raise


__all__ = ["STAMPS", "about", "data_fingerprint", "file_digest", "key_of", "prepared", "tokenizer_fingerprint"]
