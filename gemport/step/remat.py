"""Decoder-layer remat whose backward pass runs one layer at a time (Tunix Gemma 4).

Tunix rematerialises each decoder layer under ``RematConfig.DECODER`` with ``nnx.remat``. Nothing orders a layer's
backward work against the other layers', and TPU's scheduler keeps two [T, F] MLP products of every layer live
until the end of the backward pass, where the LoRA factors' gradient dots it delays read them: the step's memory
grows with every layer, far past the plan at Gemma 4 31B's 60 layers (docs/mesh.md has the compiled figures).
Here each layer's backward pass is bracketed by two ``optimization_barrier``s:
- its saved inputs pass through one with its output's cotangent, so the recomputation cannot start early;
- all its cotangents (input and params) leave through another, so none is computed after the layer's
  backward pass has moved on.
One layer's backward temporaries are then live at a time. The arithmetic is ``nnx.remat``'s: the same forward,
differentiated by ``jax.vjp`` of the same function.
"""

from __future__ import annotations

import functools
import sys

import jax
from flax import nnx

from gemport.lora.qwix import PROJECTION
from gemport.step.precision import backward_at, traced


def rematerialize(f, frozen: tuple[int, ...] = ()):
    """``f`` with the same values and derivatives, differentiated by recomputing ``f`` in the backward pass once
    the cotangent of its output exists, all of its input cotangents computed together.

    f: a function of pytrees of arrays (integer arrays get float0 cotangents). The forward pass keeps only
    the arguments; the backward pass's products take the precision of the products traced where ``f`` is
    wrapped (``step.precision.traced``).
    frozen: positions of arguments the backward pass does not differentiate: their cotangent is zero (None), and
    no product of it is computed (a layer's frozen weights: their gradients would cost 2N FLOPs a token).
    """
    precision = traced()

    @jax.custom_vjp
    def g(*args):
        return f(*args)

    def forward(*args):
        return f(*args), args

    def backward(args, cotangent):
        args, cotangent = jax.lax.optimization_barrier((args, cotangent))
        moving = [i for i in range(len(args)) if i not in frozen]

        def of_moving(*values):
            return f(*[values[moving.index(i)] if i in moving else a for i, a in enumerate(args)])

        with backward_at(precision):
            moved = jax.lax.optimization_barrier(jax.vjp(of_moving, *[args[i] for i in moving])[1](cotangent))
        return tuple(moved[moving.index(i)] if i in moving else None for i in range(len(args)))

    g.defvjp(forward, backward)
    return g


@functools.cache
def _tied(layer_cls: type) -> type:
    decoder = sys.modules[layer_cls.__module__].RematConfig.DECODER

    def __call__(self, x, segment_pos, cache, attn_mask, *args, **kwargs):
        # Tunix's layers take the enum or its value.
        if cache is not None or self.config.remat_config not in (decoder, decoder.value):
            return layer_cls.__call__(self, x, segment_pos, cache, attn_mask, *args, **kwargs)
        # The frozen weights (everything but LoRA's factors) enter undifferentiated: the train step never asks
        # their gradients, and inside the custom_vjp nothing else would say so.
        graphdef, lora, weights = nnx.split(self, nnx.LoRAParam, ...)

        def layer(weights, lora, x, segment_pos, attn_mask, args, kwargs):
            return nnx.merge(graphdef, lora, weights).block(x, segment_pos, None, attn_mask, *args, **kwargs)

        primal = (nnx.as_pure(weights), nnx.as_pure(lora), x, segment_pos, attn_mask, args, kwargs)
        # custom_vjp differentiates its arguments only, and a layer with Qwix's LoRA also reads traced values
        # it closes over (without this their gradients were zero): closure_convert makes them arguments.
        converted, consts = jax.closure_convert(layer, *primal)
        return rematerialize(converted, frozen=(0,))(*primal, *consts)

    return type(f"Tied{layer_cls.__name__}", (layer_cls,), {"__call__": __call__, "__module__": __name__})


def tied_remat_model(model: nnx.Module) -> nnx.Module:
    """A copy of a Tunix Gemma 4 model whose decoder layers, under ``RematConfig.DECODER``, are rematerialised
    by ``rematerialize``: the same values and gradients as Tunix's ``nnx.remat``, one layer's backward
    temporaries live at a time. Other remat configs, a KV cache and other models (Gemma 3, whose layers run
    nnx transforms of their own inside) run as Tunix runs them. The copy shares the arrays of ``model``;
    ``model`` is not changed."""
    from tunix.models.gemma4 import model as gemma4  # optional: tunix extra

    copy = nnx.merge(*nnx.split(model))
    for _, module in nnx.iter_modules(copy):
        if type(module) is gemma4.DecoderLayer:
            module.__class__ = _tied(type(module))
    return copy


SAVED = {
    "decoder": jax.checkpoint_policies.nothing_saveable,
    "projections": jax.checkpoint_policies.save_only_these_names(PROJECTION),
}
"""What a rematerialised decoder layer keeps for its backward pass, per remat: ``"decoder"`` its input only
(everything recomputed, Tunix's decoder remat); ``"projections"`` also its adapted projections' frozen products
(``lora.qwix.PROJECTION``), so the backward pass recomputes the norms, activations, attention and LoRA branches
but not the big products: about 4N FLOPs a token instead of 6N, for the products' memory. Honoured by the scanned
decoder (``step.scan``), which runs every layer of a model under it."""


def set_remat(model: nnx.Module, remat: str) -> None:
    """Set Tunix's ``remat_config`` of ``model`` to ``remat`` ("none", "block", "decoder"; "projections" is
    Tunix's decoder remat keeping the projections' products, `SAVED`), in place, and record ``remat`` on
    ``model`` (``model.remat``) for the scan (``step.scan.scanned_decoder``) to read.

    model: a Tunix Gemma 3 / Gemma 4 (its ``RematConfig`` is its config's module's). Qwix creates the LoRA params
    on a first call, which fails inside ``nnx.remat``; so a model gets its LoRA without remat and the remat policy
    afterwards. Gemma 3's attention keeps its own copy of the field.
    """
    tunix = "decoder" if remat in SAVED else remat
    value = sys.modules[type(model.config).__module__].RematConfig[tunix.upper()]
    for _, module in nnx.iter_modules(model):
        for holder in (module, getattr(module, "config", None)):
            if hasattr(holder, "remat_config"):
                holder.remat_config = value
    model.remat = remat
