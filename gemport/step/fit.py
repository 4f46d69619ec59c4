"""Remat that fits: what ``gradient_checkpointing: true`` trains.

TRL's ``gradient_checkpointing`` asks for memory to be saved, not for a policy. Decoder remat (``step.remat``) keeps
one layer's input and recomputes the rest, about 6N FLOPs a token for the 4N a step counts; remat "projections"
also keeps the adapted projections' products, about 4N, for their memory (``step.remat.SAVED``). On a TPU, where
XLA refuses at compile time a program past the chips' HBM (``RESOURCE_EXHAUSTED``), the run compiles "projections"
first and takes decoder remat only where it is refused (``FIT``): the step keeps what fits and recomputes the rest.
Elsewhere (XLA:CPU and GPU compile any size, and fail only when running) it takes decoder remat, as HF does.

Both remats compute the same values and gradients (``tests/step/test_scan.py``); only memory and time differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax
from flax import nnx

from gemport.errors import BatchError
from gemport.lora import LoraSpec
from gemport.specs import GemmaSpec
from gemport.step.remat import set_remat
from gemport.step.scan import scanned_period

T = TypeVar("T")

FIT = ("projections", "decoder")
"""The remats ``gradient_checkpointing: true`` tries on a TPU, in order: the first whose step compiles within the
chips' memory trains."""


def fit_remats(remat: str, spec: GemmaSpec, lora_spec: LoraSpec | None, platform: str) -> tuple[str, ...]:
    """The remats a run of recipe remat ``remat`` (``data.sft.remat_of``) tries, in order.

    ``FIT`` for decoder remat on a TPU (``platform``: the mesh's devices') where the decoder scans under
    "projections" (``step.scan.scanned_period``: not Gemma 4 E2B/E4B's per-layer inputs and KV sharing, nor PEFT's
    ``alpha_pattern``); ``(remat,)`` otherwise.

    Example:
      >>> fit_remats("decoder", GemmaSpec.preset("gemma3-1b"), LoraSpec(rank=16), "tpu")
      ('projections', 'decoder')
      >>> fit_remats("decoder", GemmaSpec.preset("gemma3-1b"), LoraSpec(rank=16), "cpu")
      ('decoder',)
    """
    if remat == "decoder" and platform == "tpu" and scanned_period(spec, lora_spec, FIT[0]):
        return FIT
    return (remat,)


def refused(error: BaseException) -> bool:
    """Whether ``error`` is XLA refusing a program past the devices' memory (``RESOURCE_EXHAUSTED``)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def first_fitting(model: nnx.Module, remats: Sequence[str], attempt: Callable[[], T]) -> tuple[T, str, list[str]]:
    """Set each remat of ``remats`` on ``model`` in turn (``step.remat.set_remat``) and return what ``attempt()``
    (a compile, or a step's first call) gives under the first one XLA does not refuse (`refused`).

    Returns ``(result, remat, refusals)``: ``model`` is left at ``remat``; ``refusals`` has one line per remat
    refused before it (the remat and XLA's first line). Raises the last refusal when every remat is refused, and
    any other error at once.
    """
    refusals = []
    for i, remat in enumerate(remats):
        set_remat(model, remat)
        try:
            return attempt(), remat, refusals
        except Exception as e:
            if not refused(e) or i == len(remats) - 1:
                raise
            refusals.append(f"{remat} refused: {str(e).splitlines()[0]}")


def to_fit(remat: str, rows: int, seq_len: int, mesh: Mapping[str, int], batch_size: int | None = None) -> str:
    """What to change so that a step of ``rows`` x ``seq_len`` tokens per micro-batch under ``remat`` on ``mesh``
    (axis sizes, e.g. ``{"fsdp": 4, "tp": 1}``) fits the chips: ``batch_size``, the recipe's
    ``per_device_train_batch_size`` (default ``rows``).

    Example:
      >>> to_fit("decoder", 1, 8192, {"fsdp": 1, "tp": 1})
      'to fit: more chips or another mesh (a larger slice, --fsdp / --tp); or a shorter max_length (rows of 8192 tokens)'
    """
    changes = []
    if remat == "none":
        changes.append("set gradient_checkpointing: true (decoder remat keeps one layer's activations)")
    if rows > mesh.get("fsdp", 1):
        changes.append(f"fewer rows per micro-batch (per_device_train_batch_size {batch_size or rows}; raise "
                       "gradient_accumulation_steps to keep the batch)")
    changes.append("more chips or another mesh (a larger slice, --fsdp / --tp)")
    changes.append(f"a shorter max_length (rows of {seq_len} tokens)")
    return "to fit: " + "; or ".join(changes)


def mesh_text(mesh: Mapping[str, int]) -> str:
    """A mesh's axes as the messages name them.

    Example:
      >>> mesh_text({"fsdp": 1, "tp": 4})
      'fsdp=1 tp=4'
    """
    return " ".join(f"{k}={v}" for k, v in mesh.items()) or "one device"


def does_not_fit(error: BaseException, remat: str, rows: int, seq_len: int, mesh: Mapping[str, int],
                 batch_size: int | None = None) -> BatchError:
    """The error for a step XLA refused (`refused`) under ``remat``, the last the run could take: the micro-batch,
    the mesh, XLA's first line and what to change (`to_fit`)."""
    return BatchError(
        f"the train step of {rows} rows x {seq_len} tokens per micro-batch on {mesh_text(mesh)}, remat {remat}, "
        f"does not fit the chips' memory (libtpu: {str(error).splitlines()[0]}); "
        f"{to_fit(remat, rows, seq_len, mesh, batch_size)}")


def described(remat: str, remats: Sequence[str], refusals: Sequence[str]) -> str:
    """Why the step takes ``remat`` (what `first_fitting` found): empty where ``remats`` left no choice.

    Example:
      >>> described("projections", FIT, [])
      "gradient_checkpointing's first of projections, decoder to fit"
    """
    if len(remats) < 2:
        return ""
    return "; ".join([f"gradient_checkpointing's first of {', '.join(remats)} to fit", *refusals])


__all__ = ["FIT", "described", "does_not_fit", "first_fitting", "fit_remats", "mesh_text", "refused", "to_fit"]
