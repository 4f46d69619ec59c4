"""Gemma 4's mixture-of-experts block routed as transformers routes it, on Tunix 0.1.7's model.

Tunix 0.1.7's ``DecoderLayer.block`` calls ``self.moe(self.moe_pre_ffw_norm(attn))``: its ``MoERagged`` routes
tokens from the normed input, and picks experts with ``jax.lax.approx_max_k`` (approximate on TPU). HF's
``Gemma4TextDecoderLayer`` routes from the residual stream ``attn`` itself and picks the exact top k; only the
experts take the normed input (``pre_feedforward_layernorm_2``). The two agree only where that norm's weights are
constant. Here, in the Tunix model gemport builds, two modules of each MoE layer take other classes (their
parameters, paths and shardings unchanged): ``moe_pre_ffw_norm`` passes the residual on beside its output, and
``moe`` routes from that residual with an exact top k, then runs Tunix's experts on the normed input. Tunix's
private expert helpers and the Tunix version this was written against are in ``gemport._src.upstream``.

The experts run as Tunix's ``_run_ffw_and_routing`` runs them (its dispatch and collection helpers, two
``ragged_dot``), with one addition Qwix cannot make (it does not intercept ``ragged_dot``): LoRA on the expert
weights, PEFT's ``target_parameters`` (`gemport.lora.experts`, attached with `attach_expert_lora`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flax import nnx

from gemport._src import upstream
from gemport.errors import LoraError
from gemport._src.upstream import TUNIX_VERSION  # the version this was written against, checked there at import


@functools.cache
def _classes():
    from tunix.models.gemma4 import model as g4  # Tunix, an extra, on first use
    from tunix.models.gemma4 import moe  # Tunix, an extra, on first use

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
            if (a := getattr(self, "router_logits_lora_a", None)) is not None:  # PEFT's router.proj.weight LoRA
                a, b = a.get_value(), self.router_logits_lora_b.get_value()
                # Two einsums of two operands: Qwix's interception (on the whole model) takes no more.
                low = jnp.einsum("btd,dr->btr", x.astype(jnp.promote_types(x.dtype, a.dtype)), a)
                delta = jnp.einsum("btr,re->bte", low, b)
                logits = (logits + delta * self.router_logits_lora_scale).astype(logits.dtype)
            weights, choices = route(logits, self.num_experts_per_datapoint)
            return self._experts(normed, choices, weights)

        def _experts(self, x, choices, weights):
            """Tunix's ``_run_ffw_and_routing`` (its dispatch, ragged dots and combination), plus the LoRA of
            each expert weight that carries one (`gemport.lora.experts`): x [B, T, D] -> [B, T, D]."""
            counts, xs, reverse, combine = upstream.expert_dispatch(x, choices, weights)
            dtype = self.config.dtype
            w_gate = jnp.transpose(self.gating_einsum.get_value(), (0, 3, 1, 2))
            w_gate = w_gate.reshape(self.num_experts, self.features, 2 * self.hidden_dim)
            gate = jax.lax.ragged_dot(xs, w_gate.astype(dtype), group_sizes=counts)
            gate = self._lora("gating_einsum", xs, counts, gate).reshape(gate.shape[0], 2, self.hidden_dim)
            hidden = nnx.gelu(gate[:, 0, :]) * gate[:, 1, :]
            out = jax.lax.ragged_dot(hidden, self.linear.get_value().astype(dtype), group_sizes=counts)
            out = self._lora("linear", hidden, counts, out)
            expert = jnp.repeat(jnp.arange(self.num_experts), counts, total_repeat_length=out.shape[0])
            out = out * self.per_expert_scale.get_value().astype(out.dtype)[expert, None]
            out = upstream.expert_collect(out, xs_reverse_argsort=reverse, xs_combine_weights=combine)
            return jnp.einsum("blkd,blk->bld", out, combine, preferred_element_type=out.dtype)

        def _lora(self, name, xs, counts, result):
            """``result`` [N, out] of expert weight ``name`` on tokens ``xs`` [N, in] (sorted by expert,
            ``counts`` [E] per expert), plus ``xs @ a_e @ b_e * scale`` for each token's expert e when the
            weight has LoRA factors ``a`` [E, in, r], ``b`` [E, r, ...]; the sum in ``result``'s dtype."""
            a = getattr(self, f"{name}_lora_a", None)
            if a is None:
                return result
            b = getattr(self, f"{name}_lora_b").get_value()
            a = a.get_value()
            low = jax.lax.ragged_dot(xs.astype(jnp.promote_types(xs.dtype, a.dtype)), a, group_sizes=counts)
            delta = jax.lax.ragged_dot(low, b.reshape(b.shape[0], b.shape[1], -1), group_sizes=counts)
            return (result + delta * getattr(self, f"{name}_lora_scale")).astype(result.dtype)

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


def attach_expert_lora(module, weight: str, a, b, scale: float) -> None:
    """Give the MoE block ``module`` (routed by gemport, see `hf_routed`) LoRA factors on its expert weight
    ``weight`` (``gating_einsum`` or ``linear``: ``a`` [E, in, r] and ``b`` [E, r, ...]; ``router_logits``: ``a``
    [D, r], ``b`` [r, E]), ``nnx.LoRAParam``, and PEFT's ``scale``, which the block then adds to that weight's
    projection.

    Raises:
      LoraError: ``module`` is not a MoE block routed by gemport (Tunix's own routing has no LoRA hook).
    """

    if type(module) is not _classes()[_tunix_moe()]:
        raise LoraError(f"LoRA on the MoE experts needs the MoE block gemport routes (gemport._src.moe.model_class, "
                        f"what gemport.load_model builds), not {type(module).__name__}")
    setattr(module, f"{weight}_lora_a", a)
    setattr(module, f"{weight}_lora_b", b)
    setattr(module, f"{weight}_lora_scale", float(scale))


def _tunix_moe():
    from tunix.models.gemma4 import moe  # Tunix, an extra, on first use

    return moe.MoERagged


def hf_routed(model):
    """``model`` (a Tunix Gemma 4, changed in place and returned) with each MoE layer routed as transformers does.

    Layers without experts, and layers already routed so, are left alone.
    """

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
    from tunix.models.gemma4 import model as g4  # Tunix, an extra, on first use

    class Gemma4(g4.Gemma4):
        __doc__ = g4.Gemma4.__doc__

        def __init__(self, config, *, rngs):
            super().__init__(config, rngs=rngs)
            hf_routed(self)

    return Gemma4


__all__ = [
    "TUNIX_VERSION",
    "attach_expert_lora",
    "hf_routed",
    "model_class",
    "route",
]
