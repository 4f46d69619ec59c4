"""Gemma 4's mixture-of-experts block routed as transformers routes it, on Tunix 0.1.7's model.

Tunix 0.1.7's ``DecoderLayer.block`` calls ``self.moe(self.moe_pre_ffw_norm(attn))``: its ``MoERagged`` routes
tokens from the normed input, and picks experts with ``jax.lax.approx_max_k`` (approximate on TPU). HF's
``Gemma4TextDecoderLayer`` routes from the residual stream ``attn`` itself and picks the exact top k; only the
experts take the normed input (``pre_feedforward_layernorm_2``). The two agree only where that norm's weights are
constant. Here, in the Tunix model gemport builds, two modules of each MoE layer take other classes (their
parameters, paths and shardings unchanged): ``moe_pre_ffw_norm`` passes the residual on beside its output, and
``moe`` routes from that residual with an exact top k, then runs Tunix's experts on the normed input. Tunix's
private expert call and the Tunix version this was written against are in ``gemport._src.upstream``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gemport._src import upstream
from gemport._src.upstream import TUNIX_VERSION  # the version this was written against, checked there at import


@functools.cache
def _classes():
    from tunix.models.gemma4 import model as g4
    from tunix.models.gemma4 import moe

    class ResidualAndNorm(g4.RMSNorm):
        """``moe_pre_ffw_norm`` returning ``(x, norm(x))``: the MoE block routes from ``x`` [B, T, D] and
        runs its experts on ``norm(x)`` [B, T, D]."""

        def __call__(self, x):
            return x, super().__call__(x)

    class HFRoutedMoE(moe.MoERagged):
        """Tunix's ragged-dot experts behind HF's router: input ``(residual, normed)``, both [B, T, D]."""

        def __call__(self, inputs):
            residual, normed = inputs
            # HF's router: RMSNorm without scale (in float32), times router.scale and D^-0.5 in the model's
            # dtype, then the projection.
            x = residual.astype(jnp.float32)
            x = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-06)).astype(residual.dtype)
            x = x * self.router_scale.get_value().astype(x.dtype) * self.features**-0.5
            logits = jnp.einsum("btd,de->bte", x, self.router_logits.get_value().astype(x.dtype))
            weights, choices = route(logits, self.num_experts_per_datapoint)
            return upstream.run_experts(self, normed, choices, weights)

    return {g4.RMSNorm: ResidualAndNorm, moe.MoERagged: HFRoutedMoE}


def route(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """HF's top-k routing: softmax over the experts, the exact ``k`` largest, their weights renormalised to 1.

    Args:
      logits: router logits [..., E].
      k: experts per token.

    Returns:
      ``(weights, choices)``: float32 weights [..., E] that, read at ``choices``, sum to 1 per token (Tunix's
      ``MoERagged`` reads them there and scales by ``per_expert_scale`` itself), and int32 choices [..., k].
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, choices = jax.lax.top_k(probs, k)
    return probs / jnp.sum(top, axis=-1, keepdims=True), choices


def hf_routed(model):
    """``model`` (a Tunix Gemma 4, changed in place and returned) with each MoE layer routed as transformers does.

    Layers without experts, and layers already routed so, are left alone.
    """
    from flax import nnx

    replace = _classes()
    for _, layer in nnx.iter_modules(model):
        if hasattr(layer, "moe") and hasattr(layer, "moe_pre_ffw_norm"):
            for name in ("moe_pre_ffw_norm", "moe"):
                module = getattr(layer, name)
                module.__class__ = replace.get(type(module), type(module))
    return model


@functools.cache
def model_class():
    """Tunix's ``Gemma4`` whose MoE layers are built routed as transformers routes them (see `hf_routed`)."""
    _classes()
    from tunix.models.gemma4 import model as g4

    class Gemma4(g4.Gemma4):
        __doc__ = g4.Gemma4.__doc__

        def __init__(self, config, *, rngs):
            super().__init__(config, rngs=rngs)
            hf_routed(self)

    return Gemma4


__all__ = [
    "TUNIX_VERSION",
    "hf_routed",
    "model_class",
    "route",
]
