"""Tunix models as nnx parameter trees: built abstractly from a spec, read flat by dotted path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

if TYPE_CHECKING:  # a spec is only passed through: _src sits below gemport.specs, which imports it
    from gemport.specs import GemmaSpec


def path_str(path) -> str:
    """A dotted string of an nnx state path: ``("layers", 0, "attn")`` -> ``"layers.0.attn"``."""
    return ".".join(str(p) for p in path)


def flat_params(state_or_model, kind=nnx.Param) -> dict[str, jax.Array]:
    """``{dotted path: array}`` of a model's ``kind`` variables (``nnx.Param`` includes LoRA params), or of every
    variable of an ``nnx.State``."""
    state = nnx.state(state_or_model, kind) if isinstance(state_or_model, nnx.Module) else state_or_model
    return {path_str(p): v.get_value() if hasattr(v, "get_value") else v for p, v in nnx.to_flat_state(state)}


def abstract_model(spec: GemmaSpec, *, param_dtype=None, compute_dtype=None):
    """The Tunix model of ``spec`` as shapes only (``nnx.eval_shape``): no memory, sharding annotations kept."""
    cfg = spec.to_tunix(param_dtype=param_dtype, compute_dtype=compute_dtype)
    model_cls = spec.tunix_model_class()

    def build():
        # RNG counters held as refs: updating a plain traced counter makes flax query the tracer's sharding,
        # and JAX's error text for that walks the whole trace; gemma4-31b then takes 10 s instead of 1.5 s.
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        return model_cls(cfg, rngs=rngs)

    return nnx.eval_shape(build)


def lora_state(flat: dict[str, Any]) -> nnx.State:
    """An ``nnx.State`` of ``nnx.LoRAParam`` from ``{dotted path: array}`` (the inverse of `flat_params`)."""
    return nnx.from_flat_state([
        (tuple(int(p) if p.isdigit() else p for p in name.split(".")), nnx.LoRAParam(value))
        for name, value in flat.items()
    ])


__all__ = [
    "abstract_model",
    "flat_params",
    "lora_state",
    "path_str",
]
