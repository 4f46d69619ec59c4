"""The train and test splits of ``trl sft``'s ``dataset_name``: a local file or folder, a saved dataset, or a hub name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gemport.errors import MaskError
from gemport.data.stream import Stream
from gemport.data.formats import located

_FILES = (".jsonl", ".json", ".parquet")


def load_splits(dataset_name: str | os.PathLike, dataset_config: str | None = None, *,
                train_split: str = "train", test_split: str = "test", with_test: bool = False,
                streaming: bool = False) -> tuple[Any, Any]:
    """(train, test or None) records of ``dataset_name``, as ``trl sft`` reads ``ScriptArguments``.

    dataset_name: a ``.jsonl`` / ``.json`` / ``.parquet`` file (the train split; it has no test split); a folder
        written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` of splits, or one ``Dataset``: the train
        split); any other folder, or a hub name, through ``datasets.load_dataset(dataset_name, dataset_config)``
        (a folder of ``train.jsonl`` / ``test.jsonl``... files names its splits by file name).
    with_test: also return ``test_split`` (evaluation is on); a missing one is an error naming the splits.
    streaming: ``dataset_streaming``: the train split read as a stream, as TRL reads it (``data.stream``: a file in
        a ``Stream``, a hub or folder dataset loaded with ``streaming=True``, a saved one as an iterable dataset).
    Returns what ``data.formats.read`` takes: a path or a ``datasets.Dataset`` per split (with ``streaming``, the
    train split a ``Stream`` or an ``IterableDataset``).
    """
    path = Path(dataset_name)
    if path.is_file():
        if path.suffix not in _FILES:
            raise MaskError(f"{path}: dataset_name as a file is .jsonl, .json or .parquet")
        if with_test:
            raise MaskError(f"{path}: one file is the {train_split!r} split only; evaluation needs a "
                            f"{test_split!r} split (a folder with {train_split}.jsonl and {test_split}.jsonl, or a "
                            "saved DatasetDict), or set eval_strategy: 'no'")
        return (Stream(path) if streaming else path), None
    import datasets  # optional: datasets

    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
    else:
        try:
            loaded = datasets.load_dataset(str(dataset_name), dataset_config, streaming=streaming)
        except ValueError as e:  # datasets: "BuilderConfig 'x' not found. Available: [...]"
            if dataset_config is None or repr(dataset_config) not in str(e):
                raise
            raise MaskError(f"{dataset_name}: dataset_config={dataset_config!r} is not one of its configs ({e})"
                            ) from None
        except datasets.exceptions.DatasetGenerationError as e:
            _name_bad_record(path)  # datasets says "row 1" of no file: read the folder's files to name the line
            raise MaskError(f"{dataset_name}: datasets could not read it ({e.__cause__ or e}); check its files") from None
    if isinstance(loaded, (datasets.Dataset, datasets.IterableDataset)):
        loaded = datasets.DatasetDict({train_split: loaded})
    wanted = [train_split] + ([test_split] if with_test else [])
    for split in wanted:
        if split not in loaded:
            raise MaskError(f"{dataset_name}: no split {split!r} (splits: {sorted(loaded)}); set "
                            f"dataset_{'train' if split == train_split else 'test'}_split"
                            + ("" if split == train_split else ", or eval_strategy: 'no'"))
    train = loaded[train_split]
    if streaming and isinstance(train, datasets.Dataset):  # saved to disk: streamed from its Arrow files
        train = train.to_iterable_dataset()
    return train, loaded[test_split] if with_test else None


def _name_bad_record(folder: Path) -> None:
    """Raise MaskError naming the file and line of the first record of ``folder`` that is not valid JSON."""
    if folder.is_dir():
        for file in sorted(folder.iterdir()):
            if file.suffix in (".jsonl", ".json"):
                for _ in located(file):
                    pass


__all__ = ["load_splits"]
