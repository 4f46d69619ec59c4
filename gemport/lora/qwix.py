"""Qwix LoRA for a `LoraLayout`: PEFT's initialisation, and per-projection factors on Tunix's fused modules.

Qwix gives a module one adapter, ``x @ lora_a @ lora_b * alpha / rank``. On ``kv_einsum`` that is one A shared
by K and V: a smaller model family than PEFT's separate k_proj and v_proj adapters, and a stacked rank-2r
adapter that equals PEFT in the forward pass trains its cross blocks, which PEFT does not have. `Provider`
therefore computes the delta of a fused module per projection: ``lora_a`` (s, D, r) and ``lora_b``
(s, r, K, H), slice ``i`` being projection ``i``'s A and B with its own scale. The parameters, the function
and each factor's gradient are PEFT's; every other module goes through Qwix unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import string
from collections import defaultdict

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gemport.errors import LoraError
from gemport.lora import experts
from gemport.lora.config import FACTOR_DTYPE, LoraParams, LoraSpec
from gemport.lora.layout import Adapter, LoraLayout, factor_axes
from gemport._src import upstream
from gemport._src.params import flat_params, path_str
from gemport._src.pattern import Equation
from gemport.specs import GemmaSpec

PROJECTION = "projection"
"""The ``jax.ad_checkpoint.checkpoint_name`` of each adapted projection's frozen product (before the LoRA delta is
added): what a remat that keeps the projections' outputs saves (``step.remat``)."""


def lora_a_init(init: str, ranks: tuple[int, ...], separate: bool):
    """A JAX initializer for ``lora_a`` of shape (s?, *in_axes, r), per ``LoraSpec.init``, in ``FACTOR_DTYPE``
    or the base weight's dtype Qwix passes, whichever is wider (Qwix would create factors in the base's dtype).

    fan_in is the product of the input axes (the HF projection's input width). With separate factors of
    different ranks, the columns past a projection's own rank start (and, having no gradient, stay) zero; a
    projection of rank 0 (not targeted) is all zero.
    """

    def initializer(key, shape, dtype=jnp.float32):
        dtype = jnp.promote_types(dtype, FACTOR_DTYPE)
        lead = 1 if separate else 0
        fan_in = math.prod(shape[lead:-1])
        if init == "gaussian":
            std = jnp.asarray([1.0 / r if r else 0.0 for r in ranks], dtype).reshape((-1,) + (1,) * (len(shape) - lead))
            value = jax.random.normal(key, shape, dtype) * (std if separate else std[0])
        else:
            bound = 1.0 / math.sqrt(fan_in)
            value = jax.random.uniform(key, shape, dtype, -bound, bound)
        if separate and len(set(ranks)) > 1:
            used = jnp.arange(shape[-1]) < jnp.asarray(ranks)[:, None]
            value = value * used.reshape((len(ranks),) + (1,) * (len(shape) - 2) + (shape[-1],)).astype(dtype)
        return value

    return initializer


def lora_b_init(key, shape, dtype=jnp.float32):
    """``lora_b`` starts at zero (PEFT), in ``FACTOR_DTYPE`` or the base's dtype, whichever is wider."""
    return jnp.zeros(shape, jnp.promote_types(dtype, FACTOR_DTYPE))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule(qwix.LoraRule):
    """A Qwix LoRA rule; with ``stack`` set, the matched einsum's weight axis ``stack`` gets separate factors.

    Attributes:
      stack: index of the stacking axis ``s`` in the weight (0 for kv_einsum), or None for Qwix's own LoRA.
      scales: each projection's scale, for separate factors.
    """

    stack: int | None = None
    scales: tuple[float, ...] = ()


def _dropping(module) -> bool:
    # `lora_dropout` gives each module a "dropout" stream for one training micro-batch; elsewhere (evaluation,
    # generation, exports, Qwix's own init call with its "default"-only Rngs) there is none.
    rngs = getattr(module, "qwix_rngs", None)
    return isinstance(rngs, nnx.Rngs) and "dropout" in rngs


class Provider(upstream.lora_provider_class()):
    """``qwix.LoraProvider`` that gives fused modules one A and one B per projection (see the module doc), and
    applies a rule's dropout only inside `lora_dropout` (training), as PEFT's ``nn.Dropout`` in train mode."""

    def rule_for(self, rule):
        # Qwix drops out on every call whose rule has a dropout rate (and then needs rngs); both its plain path
        # and `einsum`'s per-projection one read the rate from here.
        if isinstance(rule, qwix.LoraRule) and rule.dropout > 0 and not _dropping(upstream.current_module()):
            rule = dataclasses.replace(rule, dropout=0.0)
        return rule

    def astype(self, x, dtype, *args, **kwargs):
        # Tunix's Gemma 4 einsums cast their weight to the compute dtype, which Qwix does not intercept; a
        # 4-bit weight casts its scales, the dtype Qwix dequantizes in.
        if upstream.is_with_aux(x):
            return x.replace(array=x.array.astype(dtype))
        return jnp.astype(x, dtype, *args, **kwargs)

    def get_intercept_map(self):
        return super().get_intercept_map() | {"jax.numpy.astype": self.astype}

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        # Gemma 3's MLP projections (nnx.Linear): Qwix's LoRA, its branch computed as `einsum`'s.
        rule = self.current_rule("dot_general")
        if not isinstance(rule, Rule):
            return super().dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
        result = checkpoint_name(upstream.ptq_dot_general(self, lhs, rhs, dimension_numbers, precision,
                                                          preferred_element_type, **kwargs), PROJECTION)
        name = upstream.find_weight(rhs)
        if name is None:
            return result
        lora_a, lora_b, shapes = upstream.lora_dot_general_params(name, rhs, dimension_numbers, rule)
        if rule.dropout > 0:
            lhs = nnx.Dropout(rule.dropout, deterministic=False)(lhs, rngs=upstream.make_rng("dropout"))
        compute = jnp.result_type(lhs)
        delta = upstream.lora_delta(lhs, lora_a.astype(compute), lora_b.astype(compute), dimension_numbers, shapes,
                                    rule.rank, precision=precision)
        out = result + delta * jnp.asarray(rule.alpha / rule.rank, delta.dtype)
        return out if upstream.is_with_aux(rhs) else out.astype(result.dtype)

    def einsum(self, einsum_str, *operands, **kwargs):
        rule = self.current_rule("einsum")
        if not isinstance(rule, Rule):
            return super().einsum(einsum_str, *operands, **kwargs)
        result = checkpoint_name(upstream.ptq_einsum(self, einsum_str, *operands, **kwargs), PROJECTION)
        lhs, rhs = operands
        name = upstream.find_weight(rhs)
        if name is None:
            return result
        if "..." in einsum_str:
            raise LoraError(f"{einsum_str!r}: LoRA factors need an einsum without ellipsis")
        equation = Equation.parse(einsum_str)
        (x_axes, w_axes), out_axes = equation.inputs, equation.output
        s = None if rule.stack is None else w_axes[rule.stack]
        r = min(set(string.ascii_letters) - equation.letters)
        a_axes, b_axes = ("".join(axes) for axes in factor_axes(w_axes, x_axes, stack=s, rank=r))
        sizes = dict(zip(w_axes, rhs.shape), **{r: rule.rank})
        transpose = {r: None} | {c: i for i, c in enumerate(w_axes)}
        lora_a, lora_b = upstream.lora_params(
            name,
            f"{x_axes},{a_axes},{b_axes}->{out_axes}",
            rule=rule,
            a_shape=tuple(sizes[c] for c in a_axes),
            b_shape=tuple(sizes[c] for c in b_axes),
            a_sharding_transpose=tuple(transpose[c] for c in a_axes),
            b_sharding_transpose=tuple(transpose[c] for c in b_axes),
        )
        if rule.dropout > 0:
            dropout = nnx.Dropout(rule.dropout, deterministic=False)
            if s is None:
                lhs = dropout(lhs, rngs=upstream.make_rng("dropout"))
            else:  # PEFT drops out each projection's input independently: one mask per slice of the stack.
                lhs = dropout(jnp.broadcast_to(lhs, (sizes[s], *lhs.shape)), rngs=upstream.make_rng("dropout"))
                x_axes = s + x_axes
        # The branch computes in its input's dtype, as torch's autocast runs PEFT's lora_A and lora_B on a bfloat16
        # base: float32 factors are cast for the products (their gradients are float32 again). So does
        # `dot_general`'s.
        compute = jnp.result_type(lhs)
        delta = jnp.einsum(f"{x_axes},{a_axes},{b_axes}->{out_axes}", lhs, lora_a.astype(compute),
                           lora_b.astype(compute), **kwargs)
        if s is None:
            scales = jnp.asarray(rule.alpha / rule.rank, delta.dtype)
        else:
            scales = jnp.asarray(rule.scales, delta.dtype).reshape(
                tuple(sizes[s] if c == s else 1 for c in out_axes))
        out = result + delta * scales
        return out if upstream.is_with_aux(rhs) else out.astype(result.dtype)


def _alternation(paths: list[str]) -> str:
    """A regex matching exactly ``paths``, with layer indices grouped: ``layers/(?:0|5)/attn/q_einsum``."""
    layers: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        _, layer, rest = path.split("/", 2)
        layers[rest].append(layer)
    return "|".join(f"layers/(?:{'|'.join(idx)})/{re.escape(rest)}" for rest, idx in layers.items())


# Every Tunix module holding an HF linear projection, for the frozen 4-bit weights QLoRA does not adapt.
_PROJECTIONS = r"layers/\d+/(?:attn/(?:q|k|kv|qkv|attn_vec)_einsum|mlp/(?:gate|up|down)_proj)"


def _rule_key(adapter: Adapter):
    stack = adapter.weight_axes.index("s") if adapter.separate else None
    return adapter.rank, adapter.ranks, adapter.scales, stack


def provider(layout: LoraLayout, *, weight_qtype: str | None = None) -> Provider:
    """The Qwix provider whose rules create exactly ``layout``'s factors, each module with its own scale.

    Module paths are anchored (``layers/(?:0|1)/attn/q_einsum``), so they never reach a vision encoder.
    Modules that differ in rank, per-projection ranks, scales or factor form get separate rules.
    ``weight_qtype`` (QLoRA, e.g. ``"nf4"``): every projection's weight is a pre-quantized Qwix ``QArray``
    (`gemport.checkpoint.quantize.load_qlora_model`), targeted or not.
    """
    lora_spec = layout.lora_spec
    groups: dict[tuple, list[str]] = defaultdict(list)
    for adapter in layout:
        groups[_rule_key(adapter)].append(adapter.qwix_path)
    rules = []
    for (rank, ranks, scales, stack), paths in groups.items():
        rules.append(Rule(
            module_path=_alternation(paths),
            rank=rank,
            alpha=max(scales) * rank,  # Qwix's own scale; separate factors use `scales` (0 for a zero slot)
            dropout=lora_spec.dropout,
            lora_a_initializer=lora_a_init(lora_spec.init, ranks, stack is not None),
            lora_b_initializer=lora_b_init,
            stack=stack,
            scales=scales,
            weight_qtype=weight_qtype,
        ))
    if weight_qtype is not None:
        rules.append(qwix.QuantizationRule(module_path=_PROJECTIONS, weight_qtype=weight_qtype))
    return Provider(rules)


def dropout_key(seed: int, micro_step: jax.typing.ArrayLike) -> jax.Array:
    """The LoRA dropout key of one training micro-batch: ``micro_step`` (int []) counts the micro-batches
    trained before it (optimizer steps times accumulation plus its index in the step), so a resumed run, whose
    optimizer state carries the count, draws the same masks as an uninterrupted one. Returns a typed key []."""
    return jax.random.fold_in(jax.random.key(seed), micro_step)


@contextlib.contextmanager
def lora_dropout(model: nnx.Module, key: jax.Array):
    """Within the block, ``model``'s LoRA dropout is on, drawn from ``key``: PEFT's ``lora_B(lora_A(dropout(x)))``
    on every adapted projection (one Bernoulli keep mask per projection, kept inputs scaled by ``1 / (1 - p)``),
    ``p`` being ``model.lora_spec.dropout``. Outside it (evaluation, generation) LoRA runs without dropout.

    Each adapted module gets its own stream (``key`` folded with its index in ``nnx.iter_modules`` order), so
    masks are independent across modules and depend on nothing but the key: a rematerialised layer redraws the
    same ones. Sets Qwix's ``qwix_rngs`` attribute on the adapted modules for the block; a model without LoRA
    dropout is left as it is. Usable inside a jit-compiled step (``key`` may be traced).

    Example::

        with lora_dropout(model, dropout_key(seed, step)):
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    """
    spec = getattr(model, "lora_spec", None)
    if spec is None or not spec.dropout:
        yield model
        return
    modules = [module for _, module in nnx.iter_modules(model)
               if any(isinstance(value, nnx.LoRAParam) for value in vars(module).values())]
    for index, module in enumerate(modules):
        module.qwix_rngs = nnx.Rngs(dropout=jax.random.fold_in(key, index))
    try:
        yield model
    finally:
        for module in modules:
            module.qwix_rngs = None  # as Qwix leaves it after apply_lora_to_model


def apply_lora(model, spec: GemmaSpec, lora: LoraSpec | LoraParams, *, seed: int = 0, qlora=None):
    """LoRA on a Tunix Gemma model; returns the new model (the input is not modified).

    The new model carries its spec as ``model.lora_spec`` (static, kept through ``nnx.split``/``merge``), so
    `gemport.checkpoint.load_lora` and the exports read its factors without ``lora_spec=``.

    Runs ``qwix.apply_lora_to_model`` with `provider` on a dummy batch. Each factor carries its base weight's
    sharding annotation with the rank axis unsharded (`LoraLayout.specs`) and, on a mesh, is placed
    accordingly: no `gemport.mesh.fix_lora` needed. The factors are float32 on a bfloat16 or float32 base
    (docs/lora.md#dtypes).

    Args:
      model: a Tunix Gemma model of ``spec`` (e.g. from `gemport.checkpoint.load_model`), on a mesh or not.
      spec: its architecture.
      lora: a `LoraSpec`, for fresh factors started per ``lora.init`` from ``seed`` (B zero, as PEFT); or
        `LoraParams` (e.g. from `gemport.checkpoint.import_peft` or `load_lora`), whose factors are placed into
        the new model's shardings.
      qlora: the `gemport.lora.QLoraSpec` of a 4-bit base from `gemport.checkpoint.quantize.load_qlora_model`
        (QLoRA).

    Returns:
      The model with LoRA: each target einsum's ``lora_a`` [.., D_in, r] and ``lora_b`` [r, .., D_out] are
      ``nnx.LoRAParam`` (train them with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``).

    Raises:
      MissingTensorError, UnexpectedTensorError, ShapeMismatchError, LoraError: ``lora.params`` does not hold
        exactly the layout's factors, with their shapes and finite values (`LoraLayout.match`).

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers):

      >>> import jax
      >>> from flax import nnx
      >>> from gemport import GemmaSpec, LoraSpec, apply_lora, load_model
      >>> spec = GemmaSpec.from_hf(checkpoint)
      >>> model = apply_lora(load_model(checkpoint), spec, LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")))
      >>> factors = nnx.state(model, nnx.LoRAParam)
      >>> len(jax.tree.leaves(factors)), str(jax.tree.leaves(factors)[0].dtype)
      (24, 'float32')
    """
    lora_spec, params = (lora.lora_spec, lora.params) if isinstance(lora, LoraParams) else (lora, None)
    if not isinstance(lora_spec, LoraSpec):
        raise LoraError(f"apply_lora: lora is a {type(lora).__name__}; pass a LoraSpec or LoraParams")
    layout = LoraLayout(spec, lora_spec)
    tokens = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(2)[None]
    mask = jnp.tril(jnp.ones((1, 2, 2), bool))
    rules = provider(layout, weight_qtype=qlora.qtype if qlora is not None else None)
    with upstream.tracer_errors_without_origin():  # an abstract model's depth is otherwise squared here
        lora_model = qwix.apply_lora_to_model(model, rules, tokens, positions, None, mask, rngs=nnx.Rngs(seed))
    experts.attach(lora_model, layout, seed=seed)  # PEFT's target_parameters: gemport's own LoRA, not Qwix's
    if params is not None:
        given = flat_params(params)
        layout.match(given, source="params")
        # Replacing the values of the model's own variables keeps their sharding annotations.
        placed = [(path, var.replace(jax.device_put(jnp.asarray(given[path_str(path)], var.get_value().dtype),
                                                    var.get_value().sharding)))
                  for path, var in nnx.to_flat_state(nnx.state(lora_model, nnx.LoRAParam))]
        nnx.update(lora_model, nnx.from_flat_state(placed))
    lora_model.lora_spec = lora_spec
    return lora_model
