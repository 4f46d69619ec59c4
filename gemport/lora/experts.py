"""LoRA on Gemma 4's MoE, as PEFT's ``target_parameters`` trains it (``experts.gate_up_proj``, ``experts.down_proj``,
``router.proj.weight``).

transformers stacks the experts of a layer in two parameters, ``gate_up_proj`` [E, 2I, D] and ``down_proj``
[E, D, I] (each expert's weight [out, in]). PEFT's ``ParamWrapper`` gives such a parameter one rank-r LoRA per
expert, held in two ``nn.Linear``: ``lora_A`` [E r, in] (rows expert-major: expert e's A is rows e r .. e r + r)
and ``lora_B`` [out, r E] (columns rank-major: expert e's B is columns e, E + e, ...). Expert e's weight is
``W_e + scale * B_e @ A_e``, scale alpha / r (alpha / sqrt(r) with rsLoRA), A initialised as an ``nn.Linear``
of fan-in ``in`` (or normal with std 1 / r), B zero. Several parameters of one module nest: the first one
transformers registers is innermost, so with both targets ``gate_up_proj``'s tensors are saved as
``experts.base_layer.lora_A.weight`` and ``down_proj``'s as ``experts.lora_A.weight``.

gemport holds the same numbers per expert, stacked on the Tunix weight's expert axis ``e`` in Qwix's order:

| Tunix weight | HF -> Tunix | lora_a | lora_b |
|---|---|---|---|
| moe.gating_einsum | ``e (g i) d -> e g i d`` | ``e d r`` | ``e r g i`` |
| moe.linear | ``e d i -> e i d`` | ``e i r`` | ``e r d`` |

The router's projection ``router.proj.weight`` [E, D] is a plain weight to PEFT (``lora_A`` [r, D], ``lora_B``
[E, r], saved as ``router.proj.lora_A.weight``); gemport's factors are ``moe.router_logits_lora_a`` [D, r] and
``_lora_b`` [r, E], added to the router's logits before the top k.

Each PEFT tensor maps to one gemport tensor by a reshape and a transpose (`ExpertAdapter.to_peft` /
``from_peft``), exactly; gemport's MoE block (`gemport._src.moe`) adds ``x @ a_e @ b_e * scale`` to each
routed token's expert projection.
"""

from __future__ import annotations

import dataclasses
import math

import einops
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemport.specs import names
from gemport._src.partition import Spec
from gemport._src.pattern import Pattern, words
from gemport.lora.config import EXPERT_PARAMETERS, FACTOR_DTYPE, LoraSpec
from gemport.lora.layout import factor_axes, factor_specs
from gemport.specs import GemmaSpec


@dataclasses.dataclass(frozen=True)
class ExpertAdapter:
    """PEFT's LoRA on one stacked expert parameter of one layer (see the module doc).

    Attributes:
      entry: the names-table entry of the Tunix weight, e.g. ``layers.0.moe.gating_einsum``.
      rank: r, per expert (PEFT's ``lora_A`` has E r rows).
      scale: PEFT's scale.
      a, b: einops axes of ``lora_a`` and ``lora_b``, e.g. ``"e d r"`` and ``"e r g i"``.
      hf_in, hf_out: axes of the HF parameter's input and output dimension, e.g. ``"d"`` and ``"g i"``.
    """

    entry: names.Entry
    rank: int
    scale: float
    a: str
    b: str
    hf_in: str
    hf_out: str

    @property
    def parameter(self) -> str:
        """The HF parameter relative to the text prefix, e.g. ``layers.0.experts.gate_up_proj``."""
        return self.entry.hf[0]

    @property
    def lora_a(self) -> str:
        return self.entry.tunix + "_lora_a"

    @property
    def lora_b(self) -> str:
        return self.entry.tunix + "_lora_b"

    @property
    def weight_axes(self) -> tuple[str, ...]:
        return words(self.entry.pattern.right)

    @property
    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of ``lora_a`` and ``lora_b``."""
        sizes = dict(self.entry.sizes, r=self.rank)
        return tuple(sizes[x] for x in self.a.split()), tuple(sizes[x] for x in self.b.split())

    @property
    def peft_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of PEFT's ``lora_A`` [E r, in] and ``lora_B`` [out, r E] (the router's: [r, in], [out, r])."""
        sizes = dict(self.entry.sizes)
        size = lambda axes: math.prod(sizes[x] for x in axes.split())  # noqa: E731
        experts = (sizes["e"] if self.stacked else 1) * self.rank
        return (experts, size(self.hf_in)), (size(self.hf_out), experts)

    @property
    def num_params(self) -> int:
        """PEFT's trainable count: E r (in + out)."""
        return sum(math.prod(s) for s in self.shapes)

    def specs(self, base_spec: Spec) -> tuple[Spec, Spec]:
        """Shardings of (``lora_a``, ``lora_b``) for the base weight annotated ``base_spec``: each axis keeps
        the base's entry (the expert axis too), r is unsharded."""
        return factor_specs(self.weight_axes, base_spec, self.a.split(), self.b.split())

    @property
    def stacked(self) -> bool:
        """Whether the parameter stacks experts (``e`` leads both factors); the router's projection does not."""
        return self.a.split()[0] == "e"

    def peft_key(self, targeted: tuple[str, ...]) -> str:
        """The key PEFT saves this parameter's factors under, relative to the text prefix and without
        ``.lora_A.weight``, given the spec's targeted ``parameters``: ``layers.0.experts`` or, nested inside a
        later-registered target, ``layers.0.experts.base_layer``."""
        module, name = self.parameter.rsplit(".", 1)
        if not self.stacked:
            return module
        experts = [p for p in EXPERT_PARAMETERS if p.startswith("experts.")]
        later = [p for p in targeted if p in experts and experts.index(p) > experts.index(f"experts.{name}")]
        return module + ".base_layer" * len(later)

    def to_peft(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """gemport ``lora_a``, ``lora_b`` -> PEFT's ``lora_A`` [E r, in], ``lora_B`` [out, r E] (the router's:
        [r, in], [out, r]), exactly."""
        rows, cols = ("(e r)", "(r e)") if self.stacked else ("r", "r")
        lora_A = self._rearrange(a, f"{self.a} -> {rows} ({self.hf_in})")
        lora_B = self._rearrange(b, f"{self.b} -> ({self.hf_out}) {cols}")
        return lora_A, lora_B

    def from_peft(self, lora_A: np.ndarray, lora_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """PEFT's ``lora_A``, ``lora_B`` (see `to_peft`) -> gemport ``lora_a``, ``lora_b``, exactly."""
        rows, cols = ("(e r)", "(r e)") if self.stacked else ("r", "r")
        a = self._rearrange(lora_A, f"{rows} ({self.hf_in}) -> {self.a}")
        b = self._rearrange(lora_B, f"({self.hf_out}) {cols} -> {self.b}")
        return a, b

    def delta(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``scale * B_e @ A_e`` of every expert in the HF parameter's layout [E, out, in] (the router's
        ``scale * B @ A`` [out, in]), float32."""
        lead = "e " if self.stacked else ""
        a = self._rearrange(np.asarray(a, np.float32), f"{self.a} -> {lead}r ({self.hf_in})")
        b = self._rearrange(np.asarray(b, np.float32), f"{self.b} -> {lead}({self.hf_out}) r")
        return np.einsum("...or,...ri->...oi", b, a) * np.float32(self.scale)

    def _rearrange(self, x: np.ndarray, layout: str) -> np.ndarray:
        sizes = dict(self.entry.sizes, r=self.rank)
        return einops.rearrange(x, layout, **Pattern.parse(layout).sizes_for(sizes))


def expert_adapters(spec: GemmaSpec, lora_spec: LoraSpec) -> tuple[ExpertAdapter, ...]:
    """The `ExpertAdapter` of every targeted expert parameter of every MoE layer of ``spec``, in layer order."""
    out = []
    for entry in names.entries(spec):
        if len(entry.hf) != 1 or not any(entry.hf[0].endswith("." + p) for p in lora_spec.parameters):
            continue
        out_axes, in_axes = entry.pattern.left[-2:]  # an HF expert stack is [E, out, in], the router [E, in]
        stacked = len(entry.pattern.left) == 3
        a, b = factor_axes(words(entry.pattern.right), in_axes, stack="e" if stacked else None)
        module = entry.hf[0]
        out.append(ExpertAdapter(
            entry=entry,
            rank=lora_spec.rank_of(module),
            scale=lora_spec.scale_of(module),
            a=" ".join(a),
            b=" ".join(b),
            hf_in=" ".join(in_axes),
            hf_out=" ".join(out_axes),
        ))
    return tuple(out)


__all__ = ["ExpertAdapter", "expert_adapters"]


def attach(model, layout, *, seed: int = 0) -> None:
    """Fresh expert LoRA factors on ``model`` (a Tunix Gemma 4 built by gemport, changed in place) for every
    adapter of ``layout.experts``: ``lora_a`` started as PEFT starts ``lora_A`` (``LoraSpec.init``: uniform in
    +-1/sqrt(in) or normal with std 1/r), ``lora_b`` zero, both in ``FACTOR_DTYPE`` (or the base's, if wider),
    annotated with the base weight's sharding (`ExpertAdapter.specs`) and placed on its mesh, if any.

    Args:
      model: the Tunix model, e.g. from `gemport.checkpoint.load_model`.
      layout: its `gemport.lora.LoraLayout`.
      seed: the factors' seed; each adapter draws from it folded with its index.
    """
    from gemport._src.moe import attach_expert_lora  # Tunix, an extra
    from gemport.lora.qwix import lora_a_init, lora_b_init  # cycle: lora.qwix lays adapters out with this module

    for index, adapter in enumerate(layout.experts):
        module = model
        for part in adapter.entry.module.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        base = getattr(module, adapter.entry.tunix.rsplit(".", 1)[1])
        value = base.get_value()
        dtype = jnp.promote_types(value.dtype, FACTOR_DTYPE)
        key = jax.random.fold_in(jax.random.key(seed), index)
        shape_a, shape_b = adapter.shapes
        ranks = (adapter.rank,) * (shape_a[0] if adapter.stacked else 1)
        a = lora_a_init(layout.lora_spec.init, ranks, adapter.stacked)(key, shape_a, dtype)
        b = lora_b_init(key, shape_b, dtype)
        # The annotation's key is Flax's (``out_sharding`` from 0.12.4, ``sharding_names`` before), as Qwix reads it.
        metadata = base.get_metadata()
        field = "out_sharding" if "out_sharding" in metadata else "sharding_names"
        factors = []
        for array, spec in zip((a, b), adapter.specs(tuple(metadata.get(field) or ()))):
            if isinstance(value.sharding, jax.sharding.NamedSharding):
                array = jax.device_put(array, jax.sharding.NamedSharding(value.sharding.mesh,
                                                                         jax.sharding.PartitionSpec(*spec)))
            factors.append(nnx.LoRAParam(array, **{field: spec}))
        attach_expert_lora(module, adapter.entry.tunix.rsplit(".", 1)[1], *factors, adapter.scale)
