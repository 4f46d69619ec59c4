"""An HF checkpoint directory: ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.

The index and every shard header are validated on open; tensors are then read one at a time.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from gemport.checkpoint.safetensors import SafetensorsFile, TensorInfo, read_array
from gemport.errors import CheckpointError, CorruptFileError, MissingTensorError, SpecError, UnsafePathError
from gemport._src.jsonfile import Fields, read_json
from gemport.specs import GemmaSpec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def resolve_spec(base_dir: str | Path | None, spec: GemmaSpec | None, name: str = "base_dir") -> GemmaSpec:
    """The architecture a checkpoint function works on: ``base_dir``'s config.json, or ``spec``; both must agree.

    Raises:
      SpecError: neither is given, or ``spec`` differs from what ``base_dir`` says (naming the fields).
    """
    if base_dir is None:
        if spec is None:
            raise SpecError(f"no architecture: pass {name}= (the HF checkpoint) or spec= (e.g. GemmaSpec.preset)")
        return spec
    found = GemmaSpec.from_hf(base_dir)
    if spec is not None and spec != found:
        differ = [f"{f.name} {getattr(found, f.name)} != {getattr(spec, f.name)}"
                  for f in dataclasses.fields(found) if getattr(found, f.name) != getattr(spec, f.name)]
        raise SpecError(
            f"{name} {base_dir} is another model than spec ({'; '.join(differ[:3])}); pass the checkpoint the weights "
            "belong to, or leave spec out"
        )
    return found


def hub_repo(directory: str | Path) -> Path | None:
    """The repository folder (``models--org--name``) when ``directory`` is a snapshot in the Hugging Face hub
    cache (``models--org--name/snapshots/<revision>``), whose files are links to the repository's ``blobs/``."""
    real = Path(directory).resolve()
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return None


class HFCheckpoint:
    """The safetensors of an HF checkpoint directory, keyed by tensor name.

    Every file read must lie in the directory, and resolve (through links) inside it too, or, for a snapshot
    of the Hugging Face hub cache, inside its repository's ``blobs/``. Raises ``CheckpointError`` subclasses
    naming the file: no safetensors at all, an index that is not a JSON object mapping tensor names to shard
    names, a shard or link outside the directory (``UnsafePathError``), a missing shard, or an index and
    shards that disagree on where a tensor is (``CorruptFileError``).
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory; pass an HF checkpoint directory")
        repo = hub_repo(self.dir)
        self._roots = (self.dir.resolve(),) + ((repo / "blobs",) if repo else ())
        self.tensors: dict[str, TensorInfo] = {}
        index = self.dir / INDEX
        if index.is_file():
            self._open_index(self.file(INDEX))
        elif (self.dir / SINGLE).is_file():
            self.tensors = dict(SafetensorsFile(self.file(SINGLE)).tensors)
        else:
            found = sorted(p.name for p in self.dir.iterdir())[:10]
            raise CheckpointError(
                f"{self.dir}: neither {INDEX} nor {SINGLE} is here (found {found}); save the model with "
                "save_pretrained(..., safe_serialization=True)"
            )

    def file(self, name: str, referrer: str | Path | None = None) -> Path:
        """The path of file ``name`` of the checkpoint, refused (``UnsafePathError``) if it lies outside it."""
        where = f"{referrer} {name!r}" if referrer else str(self.dir / name)
        path = Path(os.path.abspath(self.dir / name))  # normalised, links not followed
        if Path(name).is_absolute() or not path.is_relative_to(os.path.abspath(self.dir)):
            raise UnsafePathError(f"{where} is outside {self.dir}; refusing to read it")
        real = path.resolve()
        if not any(real.is_relative_to(root) for root in self._roots):
            allowed = " or its hub cache repository's blobs/" if len(self._roots) > 1 else ""
            raise UnsafePathError(
                f"{where} is a link to {real}, outside {self.dir}{allowed}; refusing to read it. Copy the file "
                "into the checkpoint directory if it is meant to be there"
            )
        return path

    def _open_index(self, index: Path) -> None:
        fields = Fields(read_json(index, INDEX, CorruptFileError, "an HF checkpoint directory"), str(index),
                        CorruptFileError)
        weight_map = fields.mapping("weight_map")
        shards: dict[str, SafetensorsFile] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CorruptFileError(
                    f"{index}: tensor {name!r} maps to {shard!r}, not a shard file name; the index is damaged, "
                    "download it again"
                )
            if shard not in shards:
                path = self.file(shard, referrer=f"{index}: the shard of tensor {name!r},")
                if not path.is_file():
                    raise CheckpointError(
                        f"{index}: tensor {name!r} is in shard {shard!r}, which is missing from {self.dir}; "
                        "the download is incomplete"
                    )
                shards[shard] = SafetensorsFile(path)
            if name not in shards[shard].tensors:
                raise CorruptFileError(f"{index}: says {name!r} is in {shard!r}, but that shard does not hold it")
            self.tensors[name] = shards[shard].tensors[name]
        for shard, file in shards.items():
            unlisted = sorted(k for k in file.tensors if weight_map.get(k) != shard)
            if unlisted:
                raise CorruptFileError(
                    f"{index}: shard {shard!r} holds {unlisted[0]!r} ({len(unlisted)} tensors in all), which the "
                    "index does not map to it; the index and the shards disagree, download them again"
                )

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
