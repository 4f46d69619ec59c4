"""The precision of a step's matrix products, as the recipe says.

A float32 recipe (``bf16: false``) describes float32 products. On a TPU, JAX's default precision multiplies float32
operands in one bfloat16 pass (about three decimal digits), so it would train another run than the recipe's;
``"highest"`` multiplies them in float32 (the TPU's six-pass bfloat16 arithmetic; CPUs and GPUs without TF32 do
so at every precision). HF's ``tf32: true`` asks for TF32 products on a GPU: ``"high"`` (three bfloat16 passes on a
TPU, about as precise). A bfloat16 recipe multiplies bfloat16 operands, which one pass holds exactly, and takes its
float32 LoRA factors in bfloat16 as torch's autocast does: ``"default"``.

``matmul_precision`` is the one reading of the recipe; ``with_precision`` traces a function under it, so every
product of the step, and its transpose in the backward pass, carries it (``run.trainer.HFPeftTrainer`` traces its
train and eval steps so), and, at every precision, with RoPE's inverse frequencies computed on the host
(``step.rope``) where Tunix computes timescales with a power a TPU computes 80 times less exactly than a CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax

from gemport.step.rope import exact_rope

Precision = Literal["default", "high", "highest"]
"""``jax.default_matmul_precision``'s names for one, three or six bfloat16 passes on a TPU."""


def matmul_precision(bf16: bool | None, tf32: bool | None) -> Precision:
    """The precision of a recipe's products: ``"default"`` for a bfloat16 recipe (``bf16``), else ``"high"`` with
    ``tf32`` and ``"highest"`` (float32 products) without it.

    Example:
      >>> matmul_precision(bf16=False, tf32=None), matmul_precision(False, True), matmul_precision(True, None)
      ('highest', 'high', 'default')
    """
    if bf16:
        return "default"
    return "high" if tf32 else "highest"


def describe(precision: Precision) -> str:
    """What the commands print of a step's products, e.g. ``"float32 products (precision highest)"``."""
    what = {"highest": "float32", "high": "TF32-like (three bfloat16 passes on a TPU)", "default": "bfloat16"}
    return f"{what[precision]} products (precision {precision})"


def with_precision(fn: Callable[..., Any], precision: Precision) -> Callable[..., Any]:
    """``fn`` traced under ``jax.default_matmul_precision(precision)``: each product it makes (and, being recorded
    with it, each product its derivative makes) at that precision (``"default"``: JAX's), and under
    ``rope.exact_rope``: its Tunix models' RoPE at the host's inverse frequencies. gemport's own ``custom_vjp``s
    carry the precision into their backward pass (``traced``); another library's (splash attention's) takes it only
    when the differentiation is traced inside ``fn``, so wrap the whole step, as the trainer and ``parity`` do."""

    @functools.wraps(fn)
    def precise(*args: Any, **kwargs: Any) -> Any:
        with exact_rope(), (jax.default_matmul_precision(precision) if precision != "default"
                            else contextlib.nullcontext()):
            return fn(*args, **kwargs)

    return precise


def traced() -> Precision | str | None:
    """The precision products traced now take: ``with_precision``'s (or a ``jax.default_matmul_precision`` the
    caller opened), None for JAX's default. A ``custom_vjp`` reads it in its forward pass and hands it to its
    backward pass (``backward_at``), which JAX traces once the forward's function has returned, outside any
    context the forward was traced in: without it, a loss traced under ``with_precision`` and differentiated
    outside it (``jax.grad(with_precision(loss, p))``) would take the custom backward's products at the default,
    one bfloat16 pass on a TPU."""
    return jax.config.jax_default_matmul_precision


def backward_at(precision: Precision | str | None) -> contextlib.AbstractContextManager[None]:
    """The context a ``custom_vjp``'s backward pass traces its products in: the forward's ``traced()``."""
    return jax.default_matmul_precision(precision)


__all__ = ["Precision", "backward_at", "describe", "matmul_precision", "traced", "with_precision"]
