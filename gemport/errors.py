"""The typed errors gemport raises.

Every error names its culprit (file, tensor, dimension) and says what to do about it. Catch
``GemportError`` to handle them all.
"""


class GemportError(Exception):
    """Base class of every error gemport raises on bad input."""


class SpecError(GemportError, ValueError):
    """A config describes an architecture gemport does not support, or is inconsistent."""


class CheckpointError(GemportError):
    """A checkpoint on disk cannot be read or written as asked."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the architecture needs is not in the checkpoint."""

    def __str__(self):
        return Exception.__str__(self)


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds a tensor that the architecture does not have."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A tensor's shape disagrees with the config."""


class CorruptFileError(CheckpointError):
    """A file is truncated, malformed, or its contents disagree with its header or index."""


class UnsafePathError(CheckpointError):
    """A path points outside the checkpoint directory, or an output would land inside an input."""


class CheckpointWarning(UserWarning):
    """Not an error: a training checkpoint was damaged and set aside; the run resumes from an older intact one."""


class TrainingError(GemportError, ArithmeticError):
    """A training step went wrong in a way that would silently spoil what follows (a non-finite loss or
    gradient); names the step and the last checkpoint to resume from."""


class MeshError(GemportError, ValueError):
    """A mesh does not fit the model: an axis does not divide a dimension it shards."""


class Preempted(GemportError):
    """Not bad input: a run stopped on SIGTERM after saving a checkpoint; run the same command again to resume."""

    exit_code = 128 + 15  # SIGTERM
    """The status a command line exits with (a process ended by SIGTERM reports 143)."""

    def __init__(self, step: int, where: str, seconds: float) -> None:
        self.step = step
        super().__init__(
            f"SIGTERM received: saved the checkpoint of step {step} in {where} ({seconds:.1f} s) and stopped; run "
            "the same command again to resume from it"
        )


class LoraError(GemportError, ValueError):
    """A LoRA config or adapter cannot be mapped between PEFT and Qwix/Tunix."""


class MaskError(GemportError, ValueError):
    """A conversation cannot be rendered or masked as asked."""


class TemplateMismatchError(MaskError):
    """gemport's rendering of a conversation differs from the tokenizer's ``apply_chat_template``."""


class TemplateMismatchWarning(UserWarning):
    """Not an error: ``check_template(on_mismatch="warn")`` found gemport's rendering differs from the
    tokenizer's template and goes on with the closest chat format."""


class OptimizerConfigError(GemportError, ValueError):
    """HF TrainingArguments' optimizer and schedule fields ask for something gemport cannot reproduce in Optax,
    or an optimizer whose decay mask was fixed for one params tree is given another."""


class DefaultsWarning(UserWarning):
    """Not an error: an installed TRL or transformers whose defaults differ from those gemport recorded (names the
    fields and both versions); gemport follows the installed owner."""


class RecipeError(GemportError, ValueError):
    """A training recipe (TRL's SFT YAML, an ``SFTConfig``, its overrides) cannot be read, or asks for a data,
    logging or evaluation setting gemport does not reproduce; names the field."""


class BatchError(GemportError, ValueError):
    """Batches that do not fit the step they are given to: shapes, accumulation, rows, or rows a process of a
    multi-host run cannot hold."""


class VerifyError(GemportError, ValueError):
    """A comparison (``gemport.check.verify``) asked for in a way it cannot judge: a dtype it does not compare in, or no
    tolerance (neither a multiple of a measured floor nor a fixed bound)."""


class EngineError(GemportError):
    """A serving engine (vLLM) refused a checkpoint or adapter, or failed while serving it; the message is the
    engine's."""


class MissingDependencyError(GemportError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the pip extra."""


__all__ = [
    "BatchError",
    "CheckpointError",
    "CheckpointWarning",
    "CorruptFileError",
    "DefaultsWarning",
    "EngineError",
    "GemportError",
    "LoraError",
    "MaskError",
    "MeshError",
    "MissingDependencyError",
    "MissingTensorError",
    "OptimizerConfigError",
    "Preempted",
    "RecipeError",
    "ShapeMismatchError",
    "SpecError",
    "TemplateMismatchError",
    "TemplateMismatchWarning",
    "TrainingError",
    "UnexpectedTensorError",
    "UnsafePathError",
    "VerifyError",
]
