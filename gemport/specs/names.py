"""The HF <-> Tunix parameter map, as data.

One rule table per family. A rule pairs a Tunix path with the HF tensor(s) it comes from and states the
layout change as an einops pattern, read HF -> Tunix; the inverse is the same pattern read backwards. A rule
with several HF tensors stacks them on a leading axis ``s`` first (``k_proj`` + ``v_proj`` -> ``kv_einsum``).
A rule with no HF tensor names a Tunix parameter that HF checkpoints do not have because the layer never
uses it (K/V weights of Gemma 4's KV-shared layers); it is filled with a constant on load and dropped on save.

HF names here are relative to the text model's prefix; ``TEXT_PREFIXES`` lists the prefixes found in the
wild. The layouts' axis letters are ``AXES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import einops
import numpy as np

from gemport._src import pattern
from gemport.errors import CheckpointError
from gemport._src.pattern import Pattern
from gemport.specs import GemmaSpec

AXES = {
    "d": "model width", "f": "MLP width", "n": "query heads", "k": "KV heads", "h": "head width",
    "v": "vocabulary", "l": "layers", "p": "per-layer input width", "e": "experts", "i": "expert width",
    "g": "gate/up", "s": "stacked projections", "o": "layer scalar",
}  # fmt: skip
"""The axis alphabet of every layout: letter -> what the axis is (the mesh plan names sharded dims by it)."""

# Longest first, so that "model.language_model." is preferred over "model." when both could match.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


@dataclasses.dataclass(frozen=True)
class Rule:
    tunix: str
    hf: tuple[str, ...]
    layout: str
    when: str = "always"
    fill: float | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
    """One Tunix parameter and the HF tensors it is made of, for a concrete spec and layer.

    Attributes:
      tunix: dotted Tunix path, e.g. ``layers.5.attn.k_einsum.w``.
      hf: HF tensor names relative to the text prefix, e.g. ``("layers.5.self_attn.k_proj.weight",)``;
        empty for Tunix-only parameters.
      layout: einops pattern HF -> Tunix; with several HF tensors its first axis ``s`` indexes them.
      sizes: every axis length the pattern uses.
      fill: constant for Tunix-only parameters.
      module: the Tunix module path (``tunix`` without the parameter name), for LoRA.
    """

    tunix: str
    hf: tuple[str, ...]
    layout: str
    sizes: tuple[tuple[str, int], ...]
    fill: float | None = None

    @property
    def module(self) -> str:
        return self.tunix.rsplit(".", 1)[0]

    @property
    def pattern(self) -> Pattern:
        """``layout`` parsed."""
        return Pattern.parse(self.layout)

    @property
    def tunix_shape(self) -> tuple[int, ...]:
        return pattern.shape(self.pattern.right, dict(self.sizes))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """Shape of each HF tensor (all of a rule's HF tensors share it)."""
        shape = pattern.shape(self.pattern.left, dict(self.sizes))
        return shape[1:] if len(self.hf) > 1 else shape

    def to_tunix(self, arrays: list[np.ndarray]) -> np.ndarray:
        """HF tensors (in ``hf`` order) -> the Tunix parameter. Views where the layout allows."""
        x = np.stack(arrays) if len(arrays) > 1 else arrays[0]
        return einops.rearrange(x, self.layout, **dict(self.sizes))

    def to_hf(self, array) -> list[np.ndarray]:
        """The Tunix parameter -> HF tensors, in ``hf`` order."""
        x = einops.rearrange(array, self.pattern.inverse, **dict(self.sizes))
        return list(x) if len(self.hf) > 1 else [x]


# When a rule applies, per layer ---------------------------------------------------------------------------

_WHEN: dict[str, Callable[[GemmaSpec, int], bool]] = {
    "always": lambda s, i: True,
    "split_q": lambda s, i: not s.fused_qkv,
    "fused_qkv": lambda s, i: s.fused_qkv,
    "kv": lambda s, i: not s.fused_qkv and not s.layer_k_eq_v(i) and not s.layer_kv_shared(i),
    "k_eq_v": lambda s, i: s.layer_k_eq_v(i) and not s.layer_kv_shared(i),
    "own_kv": lambda s, i: not s.layer_kv_shared(i),
    "shared_kv": lambda s, i: s.layer_kv_shared(i) and not s.layer_k_eq_v(i),
    "shared_k_eq_v": lambda s, i: s.layer_kv_shared(i) and s.layer_k_eq_v(i),
    "shared_any": lambda s, i: s.layer_kv_shared(i),
    "ple": lambda s, i: s.per_layer_input_dim > 0,
    "moe": lambda s, i: s.num_experts > 0,
}

_ATTN = "layers.{i}.self_attn."

_COMMON_LAYER = (
    Rule("layers.{i}.attn.q_einsum.w", (_ATTN + "q_proj.weight",), "(n h) d -> n d h", "split_q"),
    Rule(
        "layers.{i}.attn.qkv_einsum.w",
        (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
        "s (n h) d -> s n d h",
        "fused_qkv",
    ),
    Rule(
        "layers.{i}.attn.kv_einsum.w",
        (_ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
        "s (k h) d -> s k d h",
        "kv",
    ),
    Rule("layers.{i}.attn.attn_vec_einsum.w", (_ATTN + "o_proj.weight",), "d (n h) -> n h d"),
    Rule("layers.{i}.attn._query_norm.scale", (_ATTN + "q_norm.weight",), "h -> h"),
    Rule("layers.{i}.attn._key_norm.scale", (_ATTN + "k_norm.weight",), "h -> h", "own_kv"),
    Rule("layers.{i}.mlp.gate_proj.kernel", ("layers.{i}.mlp.gate_proj.weight",), "f d -> d f"),
    Rule("layers.{i}.mlp.up_proj.kernel", ("layers.{i}.mlp.up_proj.weight",), "f d -> d f"),
    Rule("layers.{i}.mlp.down_proj.kernel", ("layers.{i}.mlp.down_proj.weight",), "d f -> f d"),
    Rule("layers.{i}.pre_attention_norm.scale", ("layers.{i}.input_layernorm.weight",), "d -> d"),
    Rule("layers.{i}.post_attention_norm.scale", ("layers.{i}.post_attention_layernorm.weight",), "d -> d"),
    Rule("layers.{i}.pre_ffw_norm.scale", ("layers.{i}.pre_feedforward_layernorm.weight",), "d -> d"),
    Rule("layers.{i}.post_ffw_norm.scale", ("layers.{i}.post_feedforward_layernorm.weight",), "d -> d"),
)

_COMMON_GLOBAL = (
    Rule("embedder.input_embedding", ("embed_tokens.weight",), "v d -> v d"),
    Rule("final_norm.scale", ("norm.weight",), "d -> d"),
)

GEMMA3 = (_COMMON_GLOBAL, _COMMON_LAYER)

GEMMA4 = (
    _COMMON_GLOBAL
    + (
        Rule("embedder.per_layer_input_embedding", ("embed_tokens_per_layer.weight",), "v (l p) -> v l p", "ple"),
        Rule("embedder.per_layer_model_projection.w", ("per_layer_model_projection.weight",), "(l p) d -> d l p", "ple"),
        Rule("embedder.per_layer_projection_norm.scale", ("per_layer_projection_norm.weight",), "p -> p", "ple"),
    ),
    _COMMON_LAYER
    + (
        Rule("layers.{i}.attn.k_einsum.w", (_ATTN + "k_proj.weight",), "(k h) d -> k d h", "k_eq_v"),
        Rule("layers.{i}.attn.kv_einsum.w", (), "s k d h -> s k d h", "shared_kv", fill=0.0),
        Rule("layers.{i}.attn.k_einsum.w", (), "k d h -> k d h", "shared_k_eq_v", fill=0.0),
        Rule("layers.{i}.attn._key_norm.scale", (), "h -> h", "shared_any", fill=1.0),
        Rule("layers.{i}.skip_scale", ("layers.{i}.layer_scalar",), "o -> o"),
        Rule("layers.{i}.per_layer_input_gate.w", ("layers.{i}.per_layer_input_gate.weight",), "p d -> d p", "ple"),
        Rule("layers.{i}.per_layer_projection.w", ("layers.{i}.per_layer_projection.weight",), "d p -> p d", "ple"),
        Rule(
            "layers.{i}.post_per_layer_input_norm.scale",
            ("layers.{i}.post_per_layer_input_norm.weight",),
            "d -> d",
            "ple",
        ),
        Rule("layers.{i}.moe.router_logits", ("layers.{i}.router.proj.weight",), "e d -> d e", "moe"),
        Rule("layers.{i}.moe.router_scale", ("layers.{i}.router.scale",), "d -> d", "moe"),
        Rule("layers.{i}.moe.per_expert_scale", ("layers.{i}.router.per_expert_scale",), "e -> e", "moe"),
        Rule("layers.{i}.moe.gating_einsum", ("layers.{i}.experts.gate_up_proj",), "e (g i) d -> e g i d", "moe"),
        Rule("layers.{i}.moe.linear", ("layers.{i}.experts.down_proj",), "e d i -> e i d", "moe"),
        Rule("layers.{i}.moe_pre_ffw_norm.scale", ("layers.{i}.pre_feedforward_layernorm_2.weight",), "d -> d", "moe"),
        Rule("layers.{i}.moe_post_ffw_norm.scale", ("layers.{i}.post_feedforward_layernorm_2.weight",), "d -> d", "moe"),
        Rule(
            "layers.{i}.dense_post_ffw_norm.scale", ("layers.{i}.post_feedforward_layernorm_1.weight",), "d -> d", "moe"
        ),
    ),
)

_TABLES = {"gemma3": GEMMA3, "gemma4": GEMMA4}


def _sizes(spec: GemmaSpec, layer: int | None) -> dict[str, int]:
    sizes = {
        "d": spec.hidden, "v": spec.vocab, "l": spec.num_layers, "p": spec.per_layer_input_dim, "n": spec.num_heads,
        "e": spec.num_experts, "i": spec.expert_dim, "g": 2, "o": 1,
    }  # fmt: skip
    if layer is not None:
        sizes.update(k=spec.layer_kv_heads(layer), h=spec.layer_head_dim(layer), f=spec.layer_mlp(layer))
    return sizes


def _entry(rule: Rule, spec: GemmaSpec, layer: int | None) -> Entry:
    sizes = _sizes(spec, layer)
    sizes["s"] = len(rule.hf) or (3 if "qkv" in rule.tunix else 2)
    used = Pattern.parse(rule.layout).letters
    fmt = {} if layer is None else {"i": layer}
    return Entry(
        tunix=rule.tunix.format(**fmt),
        hf=tuple(h.format(**fmt) for h in rule.hf),
        layout=rule.layout,
        sizes=tuple(sorted((a, n) for a, n in sizes.items() if a in used)),
        fill=rule.fill,
    )


def entries(spec: GemmaSpec) -> tuple[Entry, ...]:
    """Every Tunix parameter of ``spec``'s model with its HF sources, in checkpoint order."""
    global_rules, layer_rules = _TABLES[spec.family]
    out = [_entry(r, spec, None) for r in global_rules if _WHEN[r.when](spec, 0)]
    for i in range(spec.num_layers):
        out.extend(_entry(r, spec, i) for r in layer_rules if _WHEN[r.when](spec, i))
    return tuple(out)


def detect_prefix(keys: Iterable[str]) -> str:
    """The text-model prefix of an HF checkpoint's keys, found by its embedding table."""
    keys = set(keys)
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in keys:
            return prefix
    raise CheckpointError(
        "no text embedding found: expected one of "
        + ", ".join(p + "embed_tokens.weight" for p in TEXT_PREFIXES)
        + "; is this a Gemma checkpoint?"
    )


def owns(name: str, prefix: str) -> bool:
    """Whether an HF tensor belongs to the text model (and so must be matched by a rule).

    Everything else under the checkpoint (vision and audio towers, multimodal projectors) is handed through
    untouched. ``lm_head.weight`` is owned: Gemma ties it to the embedding, so it is dropped if present.
    """
    return name.startswith(prefix) or name == "lm_head.weight"


__all__ = [
    "AXES",
    "TEXT_PREFIXES",
    "Entry",
    "Rule",
    "detect_prefix",
    "entries",
    "owns",
]
