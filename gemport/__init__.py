"""gemport: move a Gemma LoRA fine-tuning recipe from PyTorch/HF to JAX/Tunix on TPU.

``import gemport`` is cheap: the submodules (``gemport.specs``, ``names``, ``checkpoint``, ``mesh``,
``sharding``, ``lora``, ``masks``, ``optim``, ``train``, ``verify``) load JAX and friends on first use.
"""

import importlib

from gemport.errors import (
    CheckpointError,
    CorruptFileError,
    GemportError,
    LoraError,
    MaskError,
    MeshError,
    MissingTensorError,
    OptimizerConfigError,
    ShapeMismatchError,
    SpecError,
    UnexpectedTensorError,
    UnsafePathError,
)

__version__ = "0.1.0"

_SUBMODULES = ("specs", "names", "checkpoint", "mesh", "sharding", "lora", "masks", "optim", "train", "verify")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"gemport.{name}")
    raise AttributeError(f"module 'gemport' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "CorruptFileError",
    "GemportError",
    "LoraError",
    "MaskError",
    "MeshError",
    "MissingTensorError",
    "OptimizerConfigError",
    "ShapeMismatchError",
    "SpecError",
    "UnexpectedTensorError",
    "UnsafePathError",
]
