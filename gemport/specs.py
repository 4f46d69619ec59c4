"""`GemmaSpec`: one frozen description of a Gemma text architecture.

A spec is read from an HF ``config.json`` (``GemmaSpec.from_hf``) or named (``GemmaSpec.preset``), and it
drives everything else: the HF <-> Tunix name map, mesh checks, memory plans and the Tunix ``ModelConfig``.
Features gemport cannot reproduce exactly in Tunix raise ``SpecError`` instead of building a wrong model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from gemport.errors import SpecError
from gemport.jsonfile import read_json

SLIDING = "sliding"
GLOBAL = "global"

_HF_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": GLOBAL}


@dataclasses.dataclass(frozen=True)
class GemmaSpec:
    """A Gemma text architecture.

    Attributes:
      family: ``"gemma3"`` or ``"gemma4"``.
      num_layers, hidden, mlp, vocab: depth, model width D, MLP width F, vocabulary size V.
      num_heads: query heads N (every layer).
      head_dim, num_kv_heads: head width H and KV heads K on sliding layers.
      global_head_dim, global_kv_heads: H and K on global (full-attention) layers.
      k_eq_v: global layers project K only and use it as V (Gemma 4 31B, 26B-A4B).
      sliding_window: tokens a sliding layer sees, itself included.
      layer_types: ``"sliding"`` or ``"global"`` per layer.
      per_layer_input_dim: width P of Gemma 4's per-layer input embeddings (0 = none).
      num_kv_shared_layers: trailing layers that reuse earlier layers' K/V (no K/V weights of their own).
      double_wide_mlp: KV-shared layers have an MLP of width 2F.
      num_experts, experts_per_token, expert_dim: the MoE block (0 = dense).
      tied_embeddings: the LM head is the input embedding (always so in Tunix).
      final_logit_softcap: tanh cap on logits, or None.
      norm: ``"scale"`` (x * w, Gemma 4) or ``"one_plus_scale"`` (x * (1 + w), Gemma 2/3).
      local_rope_base, global_rope_base: RoPE base frequencies.
      global_rope_scale: linear RoPE scaling factor of global layers (Gemma 3 4B+: 8).
      global_rope_fraction: fraction of a global head that is rotated (Gemma 4: 0.25).
      query_scale: queries are multiplied by this before attention (Gemma 3: 1/sqrt(query_pre_attn_scalar)).
    """

    family: Literal["gemma3", "gemma4"]
    num_layers: int
    hidden: int
    mlp: int
    vocab: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    global_head_dim: int
    global_kv_heads: int
    sliding_window: int
    layer_types: tuple[str, ...]
    k_eq_v: bool = False
    per_layer_input_dim: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_dim: int = 0
    tied_embeddings: bool = True
    final_logit_softcap: float | None = None
    norm: Literal["scale", "one_plus_scale"] = "scale"
    local_rope_base: float = 10_000.0
    global_rope_base: float = 1_000_000.0
    global_rope_scale: float = 1.0
    global_rope_fraction: float = 1.0
    query_scale: float = 1.0

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise SpecError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers; give one per layer"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (SLIDING, GLOBAL):
                raise SpecError(f"layer {i} has type {kind!r}; expected 'sliding' or 'global'")

    # Per-layer geometry -------------------------------------------------------------------------------

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == GLOBAL

    def layer_head_dim(self, layer: int) -> int:
        """H of ``layer``: ``global_head_dim`` on global layers, ``head_dim`` on sliding ones."""
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """K of ``layer``."""
        return self.global_kv_heads if self.is_global(layer) else self.num_kv_heads

    def layer_k_eq_v(self, layer: int) -> bool:
        """Whether ``layer`` has a K projection only (Tunix ``k_einsum``), reused as V."""
        return self.k_eq_v and self.is_global(layer)

    def layer_kv_shared(self, layer: int) -> bool:
        """Whether ``layer`` reuses an earlier layer's K/V and has no K/V weights in HF checkpoints."""
        return layer >= self.num_layers - self.num_kv_shared_layers

    def layer_mlp(self, layer: int) -> int:
        """F of ``layer``'s dense MLP."""
        return self.mlp * 2 if self.double_wide_mlp and self.layer_kv_shared(layer) else self.mlp

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the ``"sliding"`` or ``"global"`` layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def fused_qkv(self) -> bool:
        """Tunix Gemma 3 fuses Q, K and V into one ``qkv_einsum`` when there are as many KV heads as query heads."""
        return self.family == "gemma3" and self.num_heads == self.num_kv_heads

    # Constructors ---------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any]) -> GemmaSpec:
        """Read a spec from an HF checkpoint directory, a ``config.json`` path, or its parsed dict.

        Accepts Gemma 3 (``gemma3_text``, and ``gemma3`` multimodal: its ``text_config``) and Gemma 4
        (``gemma4_text``, and ``gemma4`` multimodal: its ``text_config``). Raises ``SpecError`` for other
        model types and for features Tunix cannot reproduce (attention bias, bidirectional attention,
        attention softcaps, unsupported RoPE scaling, untied embeddings).
        """
        cfg = _read_config(config)
        model_type = cfg.get("model_type")
        if model_type in ("gemma3", "gemma4"):
            text = cfg.get("text_config") or {}
            text = dict(text, model_type=text.get("model_type", f"{model_type}_text"))
            if "tie_word_embeddings" in cfg:
                text.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
            cfg = text
            model_type = cfg["model_type"]
        if model_type == "gemma3_text":
            return _gemma3_from_hf(cfg)
        if model_type == "gemma4_text":
            return _gemma4_from_hf(cfg)
        raise SpecError(
            f"model_type {model_type!r} is not a Gemma 3 or Gemma 4 text model; gemport supports "
            "gemma3, gemma3_text, gemma4 and gemma4_text configs"
        )

    @classmethod
    def preset(cls, name: str) -> GemmaSpec:
        """The spec of a published size: one of ``GemmaSpec.presets()``."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise SpecError(f"unknown preset {name!r}; known presets: {', '.join(sorted(_PRESETS))}") from None

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names accepted by ``GemmaSpec.preset``."""
        return tuple(sorted(_PRESETS))

    # Conversions ----------------------------------------------------------------------------------------

    def to_tunix(self, *, param_dtype=None, dtype=None, sharding=None):
        """The Tunix ``ModelConfig`` of this architecture (``tunix.models.gemma3`` or ``gemma4``).

        Args:
          param_dtype: dtype of the parameters (default float32).
          dtype: compute dtype (Gemma 4 only; Gemma 3 computes in ``param_dtype``).
          sharding: a Tunix ``ShardingConfig``; default is Tunix's default (axes ``fsdp`` and ``tp``).
        """
        import jax.numpy as jnp

        param_dtype = jnp.float32 if param_dtype is None else param_dtype
        if self.family == "gemma3":
            return _gemma3_to_tunix(self, param_dtype, sharding)
        return _gemma4_to_tunix(self, param_dtype, dtype or param_dtype, sharding)

    def tunix_model_class(self):
        """The Tunix model class: ``Gemma3`` or ``Gemma4``."""
        if self.family == "gemma3":
            from tunix.models.gemma3.model import Gemma3

            return Gemma3
        from tunix.models.gemma4.model import Gemma4

        return Gemma4

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict for ``Gemma3ForCausalLM`` / ``Gemma4ForCausalLM`` with this architecture."""
        hf_types = {SLIDING: "sliding_attention", GLOBAL: "full_attention"}
        common = {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.mlp,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": self.sliding_window,
            "layer_types": [hf_types[t] for t in self.layer_types],
            "final_logit_softcapping": self.final_logit_softcap,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
        }
        if self.family == "gemma3":
            full = {"rope_type": "default", "rope_theta": self.global_rope_base}
            if self.global_rope_scale != 1.0:
                full = {"rope_type": "linear", "factor": self.global_rope_scale, "rope_theta": self.global_rope_base}
            return {
                **common,
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "query_pre_attn_scalar": round(self.query_scale**-2, 6),
                "attn_logit_softcapping": None,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_base},
                    "full_attention": full,
                },
            }
        return {
            **common,
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            "global_head_dim": self.global_head_dim,
            "num_global_key_value_heads": self.global_kv_heads,
            "attention_k_eq_v": self.k_eq_v,
            "hidden_size_per_layer_input": self.per_layer_input_dim,
            "vocab_size_per_layer_input": self.vocab,
            "num_kv_shared_layers": self.num_kv_shared_layers,
            "use_double_wide_mlp": self.double_wide_mlp,
            "enable_moe_block": self.num_experts > 0,
            "num_experts": self.num_experts or None,
            "top_k_experts": self.experts_per_token or None,
            "moe_intermediate_size": self.expert_dim or None,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_base},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": self.global_rope_fraction,
                    "rope_theta": self.global_rope_base,
                },
            },
        }


# Reading HF configs ----------------------------------------------------------------------------------------


def _read_config(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    return read_json(config, "config.json", SpecError, "an HF checkpoint directory or its config.json")


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise SpecError(f"config has no {key!r}; it is required for a {cfg.get('model_type')} model")
    return cfg[key]


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    raw = cfg.get("layer_types")
    if raw is None:
        period = cfg.get("sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % period else GLOBAL for i in range(num_layers))
    unknown = sorted(set(raw) - set(_HF_LAYER_TYPES))
    if unknown:
        raise SpecError(f"layer_types has {unknown}; gemport supports sliding_attention and full_attention")
    return tuple(_HF_LAYER_TYPES[t] for t in raw)


def _rope(cfg: dict[str, Any], kind: str, legacy_theta: str, default_theta: float) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or {}
    if kind in params:
        return dict(params[kind])
    rope = {"rope_type": "default", "rope_theta": cfg.get(legacy_theta, default_theta)}
    if kind == "full_attention" and cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
    return rope


def _check_common(cfg: dict[str, Any]) -> None:
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise SpecError(f"hidden_activation {cfg['hidden_activation']!r}: Tunix Gemma uses tanh-approximated GELU only")
    if cfg.get("attention_bias"):
        raise SpecError("attention_bias=true: Tunix Gemma projections have no bias")
    if cfg.get("use_bidirectional_attention"):
        raise SpecError("use_bidirectional_attention is set: Tunix Gemma is causal only")
    if cfg.get("attn_logit_softcapping") is not None:
        raise SpecError("attn_logit_softcapping is set: Tunix Gemma 3/4 attention has no softcap")
    if cfg.get("tie_word_embeddings") is False:
        raise SpecError("tie_word_embeddings=false: Tunix Gemma always decodes with the input embedding")


def _gemma3_from_hf(cfg: dict[str, Any]) -> GemmaSpec:
    _check_common(cfg)
    num_layers = _require(cfg, "num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    tunix_cycle = tuple(SLIDING if (i + 1) % 6 else GLOBAL for i in range(num_layers))
    if layer_types != tunix_cycle:
        raise SpecError("Gemma 3 layer_types differ from the 5 sliding : 1 global cycle that Tunix Gemma 3 hard-codes")
    local, full = _rope(cfg, "sliding_attention", "rope_local_base_freq", 10_000.0), _rope(
        cfg, "full_attention", "rope_theta", 1_000_000.0
    )
    if local.get("rope_type", "default") != "default":
        raise SpecError(f"sliding-layer rope_type {local['rope_type']!r}: Tunix Gemma 3 supports 'default' only")
    if full.get("rope_type", "default") not in ("default", "linear"):
        raise SpecError(f"global-layer rope_type {full['rope_type']!r}: Tunix Gemma 3 supports 'default' and 'linear'")
    if cfg.get("final_logit_softcapping") is not None:
        raise SpecError("final_logit_softcapping is set: Tunix Gemma 3 has no logit softcap")
    hidden, heads, head_dim = _require(cfg, "hidden_size"), _require(cfg, "num_attention_heads"), cfg.get("head_dim", 256)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if scalar not in (head_dim, hidden // heads):
        raise SpecError(
            f"query_pre_attn_scalar={scalar}: Tunix Gemma 3 scales queries by head_dim ({head_dim}) or "
            f"hidden_size // num_attention_heads ({hidden // heads}) only"
        )
    kv = cfg.get("num_key_value_heads", heads)
    return GemmaSpec(
        family="gemma3",
        num_layers=num_layers,
        hidden=hidden,
        mlp=_require(cfg, "intermediate_size"),
        vocab=_require(cfg, "vocab_size"),
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv,
        global_head_dim=head_dim,
        global_kv_heads=kv,
        sliding_window=_require(cfg, "sliding_window"),
        layer_types=layer_types,
        norm="one_plus_scale",
        local_rope_base=float(local.get("rope_theta", 10_000.0)),
        global_rope_base=float(full.get("rope_theta", 1_000_000.0)),
        global_rope_scale=float(full.get("factor", 1.0)),
        query_scale=float(scalar) ** -0.5,
    )


def _gemma4_from_hf(cfg: dict[str, Any]) -> GemmaSpec:
    _check_common(cfg)
    num_layers = _require(cfg, "num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    local, full = _rope(cfg, "sliding_attention", "rope_local_base_freq", 10_000.0), _rope(
        cfg, "full_attention", "rope_theta", 1_000_000.0
    )
    if local.get("rope_type", "default") != "default" or local.get("factor", 1.0) != 1.0:
        raise SpecError(f"sliding-layer rope {local}: Tunix Gemma 4 supports unscaled 'default' RoPE only")
    if full.get("rope_type", "default") not in ("default", "proportional") or full.get("factor", 1.0) != 1.0:
        raise SpecError(f"global-layer rope {full}: Tunix Gemma 4 supports unscaled 'proportional' RoPE only")
    fraction = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    heads, kv = _require(cfg, "num_attention_heads"), cfg.get("num_key_value_heads", 1)
    ple = cfg.get("hidden_size_per_layer_input") or 0
    vocab = _require(cfg, "vocab_size")
    if ple and cfg.get("vocab_size_per_layer_input", vocab) != vocab:
        raise SpecError(
            f"vocab_size_per_layer_input={cfg['vocab_size_per_layer_input']} differs from vocab_size={vocab}: "
            "Tunix Gemma 4 sizes its per-layer embedding by vocab_size"
        )
    shared = cfg.get("num_kv_shared_layers") or 0
    if shared:
        _check_kv_sharing(layer_types, shared)
    moe = bool(cfg.get("enable_moe_block"))
    return GemmaSpec(
        family="gemma4",
        num_layers=num_layers,
        hidden=_require(cfg, "hidden_size"),
        mlp=_require(cfg, "intermediate_size"),
        vocab=vocab,
        num_heads=heads,
        head_dim=cfg.get("head_dim", 256),
        num_kv_heads=kv,
        global_head_dim=cfg.get("global_head_dim") or cfg.get("head_dim", 256),
        global_kv_heads=cfg.get("num_global_key_value_heads") or kv,
        sliding_window=_require(cfg, "sliding_window"),
        layer_types=layer_types,
        k_eq_v=bool(cfg.get("attention_k_eq_v")),
        per_layer_input_dim=ple,
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp")) and shared > 0,
        num_experts=_require(cfg, "num_experts") if moe else 0,
        experts_per_token=_require(cfg, "top_k_experts") if moe else 0,
        expert_dim=_require(cfg, "moe_intermediate_size") if moe else 0,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        norm="scale",
        local_rope_base=float(local.get("rope_theta", 10_000.0)),
        global_rope_base=float(full.get("rope_theta", 1_000_000.0)),
        global_rope_fraction=fraction,
    )


def _check_kv_sharing(layer_types: tuple[str, ...], shared: int) -> None:
    # Tunix lets shared global layers read the last unshared layer and shared sliding layers the one before it;
    # HF reads the last unshared layer of the same type. They agree only when the unshared part ends sliding, global.
    first = len(layer_types) - shared
    if first < 2 or layer_types[first - 2 : first] != (SLIDING, GLOBAL):
        raise SpecError(
            f"num_kv_shared_layers={shared}: the last two unshared layers ({first - 2}, {first - 1}) must be "
            "sliding then global for Tunix's KV sharing to match HF's"
        )


# To Tunix --------------------------------------------------------------------------------------------------------


def _sharding_or_default(module, sharding):
    return sharding if sharding is not None else module.ShardingConfig.get_default_sharding()


def _common_tunix_fields(spec: GemmaSpec) -> dict[str, Any]:
    return dict(
        num_layers=spec.num_layers,
        num_embed=spec.vocab,
        embed_dim=spec.hidden,
        hidden_dim=spec.mlp,
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
        num_kv_heads=spec.num_kv_heads,
        sliding_window_size=spec.sliding_window,
        local_base_frequency=spec.local_rope_base,
        global_base_frequency=spec.global_rope_base,
    )


def _gemma3_to_tunix(spec: GemmaSpec, param_dtype, sharding):
    from tunix.models.gemma3 import model as g3

    norm = g3.QueryPreAttentionNormalisation
    by_head = abs(spec.query_scale - spec.head_dim**-0.5) < 1e-12
    return g3.ModelConfig(
        **_common_tunix_fields(spec),
        global_scale_factor=spec.global_rope_scale,
        query_pre_attn_norm=norm.BY_ONE_OVER_SQRT_HEAD_DIM if by_head else norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS,
        shd_config=_sharding_or_default(g3, sharding),
        param_dtype=param_dtype,
    )


def _gemma4_to_tunix(spec: GemmaSpec, param_dtype, dtype, sharding):
    from tunix.models.gemma4 import model as g4

    types = {SLIDING: g4.AttentionType.LOCAL_SLIDING, GLOBAL: g4.AttentionType.GLOBAL}
    shared = spec.num_kv_shared_layers
    return g4.ModelConfig(
        **_common_tunix_fields(spec),
        num_global_kv_heads=spec.global_kv_heads,
        global_key_size=spec.global_head_dim,
        k_eq_v_global=spec.k_eq_v,
        final_logit_softcap=spec.final_logit_softcap,
        attention_pattern=tuple(types[t] for t in spec.layer_types),
        per_layer_input_dim=spec.per_layer_input_dim,
        # Tunix recovers the shared-layer count as int(L - frac * L); half a layer of slack keeps float
        # rounding (20/35 * 35 = 20.000000000000004) from losing a layer.
        frac_shared_layers=(shared - 0.5) / spec.num_layers if shared else 0.0,
        override_kv_shared_ffw_hidden=spec.mlp * 2 if spec.double_wide_mlp else None,
        global_rope_proportion=spec.global_rope_fraction,
        enable_moe=spec.num_experts > 0,
        num_experts=spec.num_experts or None,
        num_experts_per_tok=spec.experts_per_token or None,
        expert_dim=spec.expert_dim or None,
        moe_dense_hidden_dim=spec.mlp if spec.num_experts else None,
        shd_config=_sharding_or_default(g4, sharding),
        param_dtype=param_dtype,
        dtype=dtype,
    )


# Published sizes --------------------------------------------------------------------------------------------------


def _cycle(num_layers: int, period: int) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % period else GLOBAL for i in range(num_layers))


def _gemma3(num_layers, hidden, mlp, heads, kv, head_dim, window, vocab, query_scalar, rope_scale):
    return GemmaSpec(
        family="gemma3", num_layers=num_layers, hidden=hidden, mlp=mlp, vocab=vocab, num_heads=heads,
        head_dim=head_dim, num_kv_heads=kv, global_head_dim=head_dim, global_kv_heads=kv, sliding_window=window,
        layer_types=_cycle(num_layers, 6), norm="one_plus_scale", global_rope_scale=rope_scale,
        query_scale=query_scalar**-0.5,
    )  # fmt: skip


def _gemma4(num_layers, hidden, mlp, heads, kv, global_kv, window, period, **extra):
    return GemmaSpec(
        family="gemma4", num_layers=num_layers, hidden=hidden, mlp=mlp, vocab=262_144, num_heads=heads,
        head_dim=256, num_kv_heads=kv, global_head_dim=512, global_kv_heads=global_kv, sliding_window=window,
        layer_types=_cycle(num_layers, period), final_logit_softcap=30.0, global_rope_fraction=0.25, **extra,
    )  # fmt: skip


_PRESETS = {
    "gemma3-1b": _gemma3(26, 1152, 6912, 4, 1, 256, 512, 262_144, 256, 1.0),
    "gemma3-4b": _gemma3(34, 2560, 10240, 8, 4, 256, 1024, 262_208, 256, 8.0),
    "gemma3-12b": _gemma3(48, 3840, 15360, 16, 8, 256, 1024, 262_208, 256, 8.0),
    "gemma3-27b": _gemma3(62, 5376, 21504, 32, 16, 128, 1024, 262_208, 168, 8.0),
    "gemma4-e2b": _gemma4(
        35, 1536, 6144, 8, 1, 1, 512, 5, per_layer_input_dim=256, num_kv_shared_layers=20, double_wide_mlp=True
    ),
    "gemma4-e4b": _gemma4(42, 2560, 10240, 8, 2, 2, 512, 6, per_layer_input_dim=256, num_kv_shared_layers=18),
    "gemma4-31b": _gemma4(60, 5376, 21504, 32, 16, 4, 1024, 6, k_eq_v=True),
    "gemma4-26b-a4b": _gemma4(
        30, 2816, 2112, 16, 8, 2, 1024, 6, k_eq_v=True, num_experts=128, experts_per_token=8, expert_dim=704
    ),
}
