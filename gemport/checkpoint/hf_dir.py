"""An HF checkpoint directory: ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.

The index and every shard header are validated on open; tensors are then read one at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gemport.checkpoint.safetensors import SafetensorsFile, TensorInfo, read_array
from gemport.errors import CheckpointError, CorruptFileError, MissingTensorError, UnsafePathError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpoint:
    """The safetensors of an HF checkpoint directory, keyed by tensor name.

    Raises ``CheckpointError`` subclasses naming the file: no safetensors at all, an index that is not
    JSON, names a shard outside the directory (``UnsafePathError``) or a missing shard, or maps a tensor to a
    shard that does not hold it (``CorruptFileError``).
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory; pass an HF checkpoint directory")
        self.tensors: dict[str, TensorInfo] = {}
        index = self.dir / INDEX
        if index.is_file():
            self._open_index(index)
        elif (self.dir / SINGLE).is_file():
            self.tensors = dict(SafetensorsFile(self.dir / SINGLE).tensors)
        else:
            found = sorted(p.name for p in self.dir.iterdir())[:10]
            raise CheckpointError(
                f"{self.dir}: neither {INDEX} nor {SINGLE} is here (found {found}); save the model with "
                "save_pretrained(..., safe_serialization=True)"
            )

    def _open_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CorruptFileError(f"{index}: not a valid safetensors index ({e!r})") from None
        root = self.dir.resolve()
        shards: dict[str, SafetensorsFile] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                path = (self.dir / shard).resolve()
                if Path(shard).is_absolute() or not path.is_relative_to(root):
                    raise UnsafePathError(
                        f"{index}: tensor {name!r} points to {shard!r}, outside {self.dir}; refusing to read it"
                    )
                if not path.is_file():
                    raise CheckpointError(
                        f"{index}: tensor {name!r} is in shard {shard!r}, which is missing from {self.dir}; "
                        "the download is incomplete"
                    )
                shards[shard] = SafetensorsFile(path)
            if name not in shards[shard].tensors:
                raise CorruptFileError(f"{index}: says {name!r} is in {shard!r}, but that shard does not hold it")
            self.tensors[name] = shards[shard].tensors[name]

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError(f"{self.dir}: no tensor {name!r}") from None

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new numpy array, read from its shard."""
        return read_array(self.info(name))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
