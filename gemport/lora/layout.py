"""Where LoRA sits on a Tunix Gemma model, and how its factors are shaped: one answer per (GemmaSpec, LoraSpec).

PEFT adapts HF linear modules (``q_proj``, ``k_proj``...), each with ``lora_A`` [r, in] and ``lora_B``
[out, r]. Tunix's weights fuse and reshape those linears (``gemport.specs.names``): one ``kv_einsum`` (s=2, K, D, H)
holds ``k_proj`` and ``v_proj``. An `Adapter` is the LoRA of one Tunix module, derived from its names-table
entry: ``lora_a`` has the weight's input axes then r, ``lora_b`` r then the remaining axes, in the weight's
order (Qwix's convention); on a fused module with separate factors the stacking axis ``s`` leads both, so each
projection keeps its own A and B, as in PEFT:

| Tunix weight | HF -> Tunix | lora_a | lora_b |
|---|---|---|---|
| q_einsum | ``(n h) d -> n d h`` | ``d r`` | ``r n h`` |
| kv_einsum, ``fused="separate"`` | ``s (k h) d -> s k d h`` | ``s d r`` | ``s r k h`` |
| kv_einsum, ``fused="shared"`` | ``s (k h) d -> s k d h`` | ``d r`` (one A for K and V) | ``r s k h`` |
| attn_vec_einsum | ``d (n h) -> n h d`` | ``n h r`` | ``r d`` |
| mlp.down_proj | ``d f -> f d`` | ``f r`` | ``r d`` |

Targets that name only some projections of a fused module (PEFT's default q_proj + v_proj on a ``kv_einsum`` or
``qkv_einsum``) need separate factors: an untargeted projection keeps its slice of ``s`` with rank 0 and scale 0,
factors that start zero and stay zero (zero A meets zero B, so neither gets a gradient, and AdamW's decoupled
weight decay keeps a zero at zero); it has no PEFT tensors and adds nothing to the function.

`LoraLayout` holds every adapter of a model and answers from them: targets, factor shapes and shardings,
parameter counts; `gemport.lora.provider` builds the Qwix rules from it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import einops
import numpy as np

from gemport.specs import names
from gemport._src import pattern
from gemport.errors import LoraError
from gemport.lora.config import PROJECTIONS, LoraSpec
from gemport._src.partition import Spec, padded
from gemport._src.pattern import Pattern
from gemport.specs import GemmaSpec
from gemport._src.tensors import check_finite, check_tensors

if TYPE_CHECKING:
    from gemport.lora.experts import ExpertAdapter

def factor_axes(
    weight_axes: Iterable[str], in_axes: Iterable[str], *, stack: str | None = None, rank: str = "r"
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Axes of (``lora_a``, ``lora_b``) for a weight with ``weight_axes`` contracted with an input over ``in_axes``.

    Qwix's rule: the weight axes that appear in the input go to ``lora_a``, then the rank; ``lora_b`` is the
    rank, then the remaining axes, both in the weight's order. With ``stack`` (separate factors per fused
    projection) that axis leads both factors instead. Axes are names (``"d"``) or einsum letters (``"D"``):
    ``factor_axes("skdh", "d")`` is ``(("d", "r"), ("r", "s", "k", "h"))``;
    ``factor_axes("skdh", "d", stack="s")`` is ``(("s", "d", "r"), ("s", "r", "k", "h"))``.
    """
    weight_axes, in_axes = tuple(weight_axes), set(in_axes)
    lead = (stack,) if stack is not None else ()
    a = lead + tuple(x for x in weight_axes if x in in_axes and x != stack) + (rank,)
    b = lead + (rank,) + tuple(x for x in weight_axes if x not in in_axes and x != stack)
    return a, b


def factor_specs(weight_axes: Iterable[str], base_spec: Spec, *factors: Iterable[str]) -> tuple[Spec, ...]:
    """The sharding of each LoRA factor from its base weight's: every axis keeps the base entry, r is unsharded.

    E.g. kv_einsum's weight ``s k d h`` annotated (None, "tp", "fsdp", None) gives ``s d r`` (None, "fsdp",
    None) and ``s r k h`` (None, None, "tp", None). Axes are names (``"d"``) or einsum letters (``"D"``).
    """
    weight_axes = list(weight_axes)
    base = dict(zip(weight_axes, padded(base_spec, len(weight_axes))))
    return tuple(tuple(base.get(x) for x in axes) for axes in factors)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The LoRA of one Tunix module, and the PEFT adapters (one per HF projection) it stands for.

    Attributes:
      entry: the names-table entry of the module's weight, e.g. ``layers.0.attn.kv_einsum.w``.
      ranks: each HF projection's PEFT rank, in ``entry.hf`` order; 0 for a projection the targets leave out
        (a zero slot of separate factors).
      scales: each HF projection's PEFT scale (alpha / r, or alpha / sqrt(r) with rsLoRA); 0 where the rank is.
      a, b: einops axes of ``lora_a`` and ``lora_b``, e.g. ``"s d r"`` and ``"s r k h"``.
      hf_in, hf_out: axes of an HF weight's input and output dimension, e.g. ``"d"`` and ``"k h"``.
    """

    entry: names.Entry
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    a: str
    b: str
    hf_in: str
    hf_out: str

    @property
    def module(self) -> str:
        """Dotted Tunix module path, e.g. ``layers.0.attn.kv_einsum``."""
        return self.entry.module

    @property
    def qwix_path(self) -> str:
        """The module path as Qwix matches it: ``layers/0/attn/kv_einsum``."""
        return self.module.replace(".", "/")

    @property
    def weight(self) -> str:
        """The adapted parameter's name on its module: ``w`` (Einsum) or ``kernel`` (Linear)."""
        return self.entry.tunix.rsplit(".", 1)[1]

    @property
    def lora_a(self) -> str:
        return self.entry.tunix + "_lora_a"

    @property
    def lora_b(self) -> str:
        return self.entry.tunix + "_lora_b"

    @property
    def adapted(self) -> tuple[int, ...]:
        """Indices, in ``entry.hf`` order, of the projections PEFT adapts (rank > 0), e.g. ``(1,)`` for v_proj
        alone on a kv_einsum."""
        return tuple(i for i, r in enumerate(self.ranks) if r)

    @property
    def hf_modules(self) -> tuple[str, ...]:
        """The adapted HF module paths relative to the text prefix, e.g. ``("layers.0.self_attn.v_proj",)``."""
        return tuple(self.entry.hf[i].removesuffix(".weight") for i in self.adapted)

    @property
    def peft_ranks(self) -> tuple[int, ...]:
        """The rank of each of ``hf_modules``."""
        return tuple(self.ranks[i] for i in self.adapted)

    @property
    def peft_scales(self) -> tuple[float, ...]:
        """The scale of each of ``hf_modules``."""
        return tuple(self.scales[i] for i in self.adapted)

    @property
    def weight_axes(self) -> tuple[str, ...]:
        """The Tunix weight's axes, e.g. ``("s", "k", "d", "h")``."""
        return pattern.words(self.entry.pattern.right)

    @property
    def separate(self) -> bool:
        """Whether each fused projection has its own factors (``s`` leads ``lora_a``)."""
        return self.a.split()[0] == "s"

    @property
    def rank(self) -> int:
        """The factors' r: the largest projection rank (smaller ones are zero-padded, which stays exact)."""
        return max(self.ranks)

    @property
    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of ``lora_a`` and ``lora_b``."""
        sizes = dict(self.entry.sizes, r=self.rank)
        return tuple(sizes[x] for x in self.a.split()), tuple(sizes[x] for x in self.b.split())

    @property
    def num_params(self) -> int:
        """What PEFT counts as trainable for ``hf_modules``: r_i * (in + out) each, without the zero padding of
        smaller ranks and zero slots that ``shapes`` hold; a shared ``lora_a`` counts once."""
        if not self.separate:
            return sum(math.prod(s) for s in self.shapes)
        out_size, in_size = self.entry.hf_shape
        return sum(r * (in_size + out_size) for r in self.peft_ranks)

    def specs(self, base_spec: Spec) -> tuple[Spec, Spec]:
        """Shardings of (``lora_a``, ``lora_b``) for the base weight annotated ``base_spec``."""
        return factor_specs(self.weight_axes, base_spec, self.a.split(), self.b.split())

    def to_peft(self, a: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Qwix ``lora_a``, ``lora_b`` -> PEFT (``lora_A`` [r_i, in], ``lora_B`` [out, r_i]) per HF module, exactly.

        Separate factors are split along ``s`` and trimmed to each projection's rank; a shared ``lora_a``
        becomes every projection's ``lora_A``. One pair per ``hf_modules``: a zero slot gives none.
        """
        fused = len(self.entry.hf) > 1
        lead = "s " if self.separate else ""
        lora_A = self._rearrange(a, f"{self.a} -> {lead}r ({self.hf_in})")
        lora_B = self._rearrange(b, f"{self.b} -> {'s ' if fused else ''}({self.hf_out}) r")
        if not fused:
            return [(lora_A, lora_B)]
        As = list(lora_A) if self.separate else [lora_A] * len(self.ranks)
        return [(As[i][:r], lora_B[i][:, :r]) for i, r in zip(self.adapted, self.peft_ranks)]

    def from_peft(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """PEFT (``lora_A`` [r_i, in], ``lora_B`` [out, r_i]) per ``hf_modules`` -> Qwix ``lora_a``, ``lora_b``.

        Exact: each projection's factors land in its own slice of ``s``, zero-padded to ``rank`` (zero rows
        of A meet zero columns of B, so the padding adds nothing and its gradient stays zero); the slice of a
        projection PEFT does not adapt is all zero.
        """
        if not self.separate and len(pairs) > 1:
            raise LoraError(
                f"{self.module}: separate PEFT adapters for {list(self.hf_modules)} cannot be held by one shared "
                "lora_a; use LoraSpec(fused='separate')"
            )
        r, slots = self.rank, len(self.ranks)
        A = np.zeros((slots, r, pairs[0][0].shape[1]), pairs[0][0].dtype)
        B = np.zeros((slots, pairs[0][1].shape[0], r), pairs[0][1].dtype)
        for i, (A_i, B_i) in zip(self.adapted, pairs, strict=True):
            A[i, : A_i.shape[0]] = A_i
            B[i, :, : B_i.shape[1]] = B_i
        fused = len(self.entry.hf) > 1
        lead = "s " if fused else ""
        a = self._rearrange(A if fused else A[0], f"{lead}r ({self.hf_in}) -> {self.a}")
        b = self._rearrange(B if fused else B[0], f"{lead}({self.hf_out}) r -> {self.b}")
        return a, b

    def _rearrange(self, x: np.ndarray, layout: str) -> np.ndarray:
        return einops.rearrange(x, layout, **Pattern.parse(layout).sizes_for(dict(self.entry.sizes)))


def _projection(hf_name: str) -> str | None:
    parts = hf_name.split(".")
    return parts[-2] if parts[-1] == "weight" and parts[-2] in PROJECTIONS else None


def _adapter(entry: names.Entry, lora_spec: LoraSpec, adapted: list[bool]) -> Adapter:
    out_axes, in_axes = entry.pattern.left[-2:]  # an HF linear weight is [out, in], after the stacking axis s
    separate = len(entry.hf) > 1 and lora_spec.fused == "separate"
    a, b = factor_axes(pattern.words(entry.pattern.right), in_axes, stack="s" if separate else None)
    modules = [h.removesuffix(".weight") for h in entry.hf]
    return Adapter(
        entry=entry,
        ranks=tuple(lora_spec.rank_of(m) if hit else 0 for m, hit in zip(modules, adapted)),
        scales=tuple(lora_spec.scale_of(m) if hit else 0.0 for m, hit in zip(modules, adapted)),
        a=" ".join(a),
        b=" ".join(b),
        hf_in=" ".join(in_axes),
        hf_out=" ".join(out_axes),
    )


def _all_linear_extra(spec: GemmaSpec) -> list[str]:
    """Linear modules beyond ``PROJECTIONS`` that PEFT's ``all-linear`` adapts on ``spec``'s HF model."""
    extra = []
    if spec.per_layer_input_dim:
        extra += ["per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"]
    if spec.num_experts:
        extra += ["the MoE router's proj"]
    return extra


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    """Every LoRA adapter that ``lora_spec`` puts on the Tunix model of ``spec``.

    Derived from the names table: ``k_proj`` + ``v_proj`` are the ``kv_einsum`` of sliding layers and the
    ``k_einsum`` of k_eq_v global layers; KV-shared layers (no K/V weights) get nothing; vision and audio
    towers are never included. Targets naming only some projections of a fused Tunix module (PEFT's default
    q_proj + v_proj: ``v_proj`` without ``k_proj`` on a ``kv_einsum``) give the others zero slots (rank 0).
    Raises ``LoraError`` when a shared fused module would need that, or different ranks or scales per
    projection.

    Attributes:
      spec: the architecture whose Tunix model is adapted.
      lora_spec: the LoRA config (targets, rank, per-module ranks and alphas, fused form).
      adapters: one `Adapter` per adapted Tunix module, in the names table's order (iterating the layout
        yields them).
      experts: the adapters on MoE expert parameters (``lora_spec.parameters``).

    Example:

      >>> from gemport import GemmaSpec, LoraLayout, LoraSpec
      >>> layout = LoraLayout(GemmaSpec.preset("gemma3-1b"), LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj")))
      >>> len(layout), layout.num_params  # q_einsum and kv_einsum of 26 layers; PEFT's trainable count
      (52, 745472)
      >>> shapes = layout.shapes()  # kv_einsum: separate factors, k_proj's a zero slot
      >>> shapes["layers.0.attn.kv_einsum.w_lora_a"], shapes["layers.0.attn.kv_einsum.w_lora_b"]
      ((2, 1152, 8), (2, 8, 1, 256))
    """

    spec: GemmaSpec
    lora_spec: LoraSpec

    @functools.cached_property
    def adapters(self) -> tuple[Adapter, ...]:
        extra = _all_linear_extra(self.spec) if self.lora_spec.all_linear else []
        if extra:
            raise LoraError(
                f"target_modules='all-linear' on this {self.spec.family} model also adapts {', '.join(extra)} in "
                "PEFT, which Tunix LoRA cannot carry; list the projections to train (e.g. "
                f"{list(PROJECTIONS)}) in the GPU recipe and here, so both sides train the same modules"
            )
        wanted = set(self.lora_spec.targets)
        out = []
        for entry in names.entries(self.spec):
            projections = [_projection(h) for h in entry.hf]
            if not entry.hf or None in projections:
                continue
            hit = [p for p in projections if p in wanted]
            if not hit:
                continue
            if len(hit) < len(projections) and self.lora_spec.fused == "shared":
                missing = [p for p in projections if p not in wanted]
                raise LoraError(
                    f"target_modules has {hit} but not {missing}: Tunix fuses {' + '.join(projections)} into one "
                    f"{entry.module}, whose shared lora_a adapts all of them or none; use LoraSpec(fused='separate'),"
                    f" PEFT's form, where {missing} get zero factors, or add {missing} to target_modules"
                )
            adapter = _adapter(entry, self.lora_spec, [p in wanted for p in projections])
            if not adapter.separate and len(set(zip(adapter.ranks, adapter.scales))) > 1:
                raise LoraError(
                    f"{entry.module}: rank_pattern/alpha_pattern give {list(adapter.hf_modules)} ranks "
                    f"{list(adapter.ranks)} and scales {list(adapter.scales)}, which one shared adapter cannot "
                    "hold; use LoraSpec(fused='separate')"
                )
            out.append(adapter)
        return tuple(out)

    @functools.cached_property
    def experts(self) -> tuple[ExpertAdapter, ...]:
        """The LoRA on MoE expert parameters (``LoraSpec.parameters``, PEFT's ``target_parameters``)."""
        from gemport.lora.experts import expert_adapters  # built on this module's factor_axes

        return expert_adapters(self.spec, self.lora_spec)

    def __iter__(self):
        return iter(self.adapters)

    def __len__(self):
        return len(self.adapters)

    @property
    def num_params(self) -> int:
        """PEFT's trainable count, ``PeftModel.get_nb_trainable_parameters()``, for separate factors (`Adapter.
        num_params`); ``shapes`` is what the factors hold, zero padding and zero slots included."""
        return sum(a.num_params for a in self.adapters + self.experts)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"layers.0.attn.q_einsum.w_lora_a": (D, r), ...}`` for every factor, the experts' included."""
        return {name: shape for a in self.adapters + self.experts
                for name, shape in zip((a.lora_a, a.lora_b), a.shapes)}

    def specs(self, base_specs: dict[str, Spec]) -> dict[str, Spec]:
        """The sharding of every factor, from ``{Tunix weight path: its annotation}`` of the base model."""
        return {
            name: spec
            for a in self.adapters + self.experts
            for name, spec in zip((a.lora_a, a.lora_b), a.specs(base_specs[a.entry.tunix]))
        }

    def match(self, params: dict, source: str = "adapter") -> list[tuple[Adapter, np.ndarray, np.ndarray]]:
        """Pair each adapter with its ``lora_a``, ``lora_b`` in ``params`` (``{"layers.0...w_lora_a": array}``).

        Raises, naming the tensor: ``MissingTensorError`` for a targeted module without LoRA params,
        ``UnexpectedTensorError`` for params no target explains (another model, or wrong targets),
        ``ShapeMismatchError`` for shapes that do not fit the model or the spec's rank, and ``LoraError`` for
        NaN or Inf.
        """
        lora_spec = self.lora_spec
        factors = {name: (t, axes) for t in self.adapters + self.experts
                   for name, axes in ((t.lora_a, t.a), (t.lora_b, t.b))}

        def about(name: str) -> str:
            t, axes = factors[name]
            sizes = ", ".join(f"{x}={n}" for x, n in t.entry.sizes if x in axes.split())
            return f"{axes} of {t.entry.module}; {sizes}, r={t.rank}, fused={lora_spec.fused!r}"

        check_tensors(
            {name: tuple(array.shape) for name, array in params.items()},
            self.shapes(),
            source=source,
            fix=f"the adapter is for a different model, rank or fused form than this {self.spec.family} model "
                f"with targets {list(lora_spec.targets + lora_spec.parameters)}; pass the LoraSpec of the training "
                "run",
            about=about,
        )
        for name, array in params.items():
            check_finite(name, array, source=source, error=LoraError,
                         fix="the training diverged; export an earlier step")
        return [(t, params[t.lora_a], params[t.lora_b]) for t in self.adapters]

    def match_experts(self, params: dict) -> list[tuple[ExpertAdapter, np.ndarray, np.ndarray]]:
        """`match` for the expert adapters: each with its ``lora_a``, ``lora_b`` in ``params`` (same checks)."""
        self.match(params)
        return [(t, params[t.lora_a], params[t.lora_b]) for t in self.experts]
