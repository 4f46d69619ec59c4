"""gemport: move a Gemma LoRA fine-tuning recipe from PyTorch/HF to JAX/Tunix on TPU."""

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
