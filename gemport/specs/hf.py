"""HF ``config.json`` <-> ``GemmaSpec``: reading every Gemma 3/4 config layout, and writing one back."""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from gemport.errors import SpecError
from gemport._src.jsonfile import Fields, read_json
from gemport.specs.spec import GLOBAL, SLIDING, GemmaSpec, layer_cycle

_HF_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": GLOBAL}


def spec_from_hf(config: str | Path | dict[str, Any]) -> GemmaSpec:
    """See ``GemmaSpec.from_hf``."""
    cfg = _read_config(config)
    model_type = cfg.string("model_type", None)
    if model_type in ("gemma3", "gemma4"):
        text = cfg.fields("text_config")
        data = dict(text.data, model_type=text.data.get("model_type") or f"{model_type}_text")
        if "tie_word_embeddings" in cfg.data:
            data.setdefault("tie_word_embeddings", cfg.data["tie_word_embeddings"])
        cfg = Fields(data, text.source, SpecError)
        model_type = cfg.string("model_type")
    if model_type == "gemma3_text":
        return _gemma3_from_hf(cfg)
    if model_type == "gemma4_text":
        return _gemma4_from_hf(cfg)
    raise SpecError(
        f"{cfg.source}: model_type {model_type!r} is not a Gemma 3 or Gemma 4 text model; gemport supports "
        "gemma3, gemma3_text, gemma4 and gemma4_text configs"
    )


def hf_config(spec: GemmaSpec) -> dict[str, Any]:
    """See ``GemmaSpec.to_hf_config``."""
    hf_types = {SLIDING: "sliding_attention", GLOBAL: "full_attention"}
    common = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.mlp,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": spec.sliding_window,
        "layer_types": [hf_types[t] for t in spec.layer_types],
        "final_logit_softcapping": spec.final_logit_softcap,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
    }
    if spec.family == "gemma3":
        full = {"rope_type": "default", "rope_theta": spec.global_rope_base}
        if spec.global_rope_scale != 1.0:
            full = {"rope_type": "linear", "factor": spec.global_rope_scale, "rope_theta": spec.global_rope_base}
        return {
            **common,
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "query_pre_attn_scalar": round(spec.query_scale**-2, 6),
            "attn_logit_softcapping": None,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": spec.local_rope_base},
                "full_attention": full,
            },
        }
    return {
        **common,
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        # Both generations of the format, so that transformers before and after 5.15 read the same widths.
        "global_head_dim": spec.global_head_dim,
        "num_global_key_value_heads": spec.global_kv_heads,
        "per_layer_config": {
            str(i): {"head_dim": spec.global_head_dim, "num_key_value_heads": spec.global_kv_heads}
            for i, kind in enumerate(spec.layer_types) if kind == GLOBAL
        },
        "attention_k_eq_v": spec.k_eq_v,
        "hidden_size_per_layer_input": spec.per_layer_input_dim,
        "vocab_size_per_layer_input": spec.vocab,
        "num_kv_shared_layers": spec.num_kv_shared_layers,
        "use_double_wide_mlp": spec.double_wide_mlp,
        "enable_moe_block": spec.num_experts > 0,
        "num_experts": spec.num_experts or None,
        "top_k_experts": spec.experts_per_token or None,
        "moe_intermediate_size": spec.expert_dim or None,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.local_rope_base},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": spec.global_rope_fraction,
                "rope_theta": spec.global_rope_base,
            },
        },
    }


def _read_config(config: str | Path | dict[str, Any]) -> Fields:
    if isinstance(config, Mapping):
        return Fields(config, "config", SpecError)
    if not isinstance(config, (str, PathLike)):
        raise SpecError(f"config {config!r:.80}: pass an HF checkpoint directory, its config.json, or its dict")
    path = Path(config)
    data = read_json(path, "config.json", SpecError, "an HF checkpoint directory or its config.json")
    return Fields(data, str(path / "config.json" if path.is_dir() else path), SpecError)


def _layer_types(cfg: Fields, num_layers: int) -> tuple[str, ...]:
    raw = cfg.strings("layer_types", None)
    if raw is None:
        return layer_cycle(num_layers, cfg.integer("sliding_window_pattern", 6))
    unknown = sorted(set(raw) - set(_HF_LAYER_TYPES))
    if unknown:
        raise SpecError(f"{cfg.source}: layer_types has {unknown}; gemport supports sliding_attention and full_attention")
    return tuple(_HF_LAYER_TYPES[t] for t in raw)


def _rope(cfg: Fields, kind: str, legacy_theta: str, default_theta: float) -> Fields:
    params = cfg.fields("rope_parameters")
    if kind in params.data:
        rope = params.fields(kind)
    else:
        data = {"rope_type": "default", "rope_theta": cfg.data.get(legacy_theta, default_theta)}
        if kind == "full_attention" and cfg.data.get("rope_scaling"):
            data.update(cfg.mapping("rope_scaling"))
        rope = Fields(data, cfg.source, SpecError)
    rope.number("rope_theta", None, minimum=1.0)
    rope.number("factor", None, minimum=1.0)
    rope.number("partial_rotary_factor", None, minimum=0.0)
    return rope


def _check_common(cfg: Fields) -> None:
    get = cfg.data.get
    if get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise SpecError(f"hidden_activation {get('hidden_activation')!r}: Tunix Gemma uses tanh-approximated GELU only")
    if get("attention_bias"):
        raise SpecError("attention_bias=true: Tunix Gemma projections have no bias")
    if get("use_bidirectional_attention"):
        raise SpecError("use_bidirectional_attention is set: Tunix Gemma is causal only")
    if get("attn_logit_softcapping") is not None:
        raise SpecError("attn_logit_softcapping is set: Tunix Gemma 3/4 attention has no softcap")
    if get("tie_word_embeddings") is False:
        raise SpecError("tie_word_embeddings=false: Tunix Gemma always decodes with the input embedding")


def _heads(cfg: Fields, heads: int, kv_key: str, kv_default: int) -> int:
    """KV heads under ``kv_key``: grouped-query attention needs them to divide the query heads."""
    kv = cfg.integer(kv_key, kv_default)
    if heads % kv:
        raise SpecError(f"{cfg.source}: num_attention_heads={heads} is not a multiple of {kv_key}={kv}; "
                        "each KV head must serve the same number of query heads")
    return kv


def _gemma3_from_hf(cfg: Fields) -> GemmaSpec:
    _check_common(cfg)
    num_layers = cfg.integer("num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    if layer_types != layer_cycle(num_layers, 6):
        raise SpecError("Gemma 3 layer_types differ from the 5 sliding : 1 global cycle that Tunix Gemma 3 hard-codes")
    local, full = _rope(cfg, "sliding_attention", "rope_local_base_freq", 10_000.0), _rope(
        cfg, "full_attention", "rope_theta", 1_000_000.0
    )
    if local.data.get("rope_type", "default") != "default":
        raise SpecError(f"sliding-layer rope_type {local.data['rope_type']!r}: Tunix Gemma 3 supports 'default' only")
    if full.data.get("rope_type", "default") not in ("default", "linear"):
        raise SpecError(
            f"global-layer rope_type {full.data['rope_type']!r}: Tunix Gemma 3 supports 'default' and 'linear'")
    if cfg.data.get("final_logit_softcapping") is not None:
        raise SpecError("final_logit_softcapping is set: Tunix Gemma 3 has no logit softcap")
    hidden, heads, head_dim = cfg.integer("hidden_size"), cfg.integer("num_attention_heads"), cfg.integer("head_dim", 256)
    scalar = cfg.number("query_pre_attn_scalar", 256)
    if scalar not in (head_dim, hidden // heads):
        raise SpecError(
            f"query_pre_attn_scalar={scalar:g}: Tunix Gemma 3 scales queries by head_dim ({head_dim}) or "
            f"hidden_size // num_attention_heads ({hidden // heads}) only"
        )
    kv = _heads(cfg, heads, "num_key_value_heads", heads)
    return GemmaSpec(
        family="gemma3",
        num_layers=num_layers,
        hidden=hidden,
        mlp=cfg.integer("intermediate_size"),
        vocab=cfg.integer("vocab_size"),
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv,
        global_head_dim=head_dim,
        global_kv_heads=kv,
        sliding_window=cfg.integer("sliding_window"),
        layer_types=layer_types,
        norm="one_plus_scale",
        local_rope_base=local.number("rope_theta", 10_000.0),
        global_rope_base=full.number("rope_theta", 1_000_000.0),
        global_rope_scale=full.number("factor", 1.0),
        query_scale=float(scalar) ** -0.5,
    )


def _gemma4_from_hf(cfg: Fields) -> GemmaSpec:
    _check_common(cfg)
    num_layers = cfg.integer("num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    local, full = _rope(cfg, "sliding_attention", "rope_local_base_freq", 10_000.0), _rope(
        cfg, "full_attention", "rope_theta", 1_000_000.0
    )
    if local.data.get("rope_type", "default") != "default" or local.data.get("factor", 1.0) != 1.0:
        raise SpecError(f"sliding-layer rope {local.data}: Tunix Gemma 4 supports unscaled 'default' RoPE only")
    if full.data.get("rope_type", "default") not in ("default", "proportional") or full.data.get("factor", 1.0) != 1.0:
        raise SpecError(f"global-layer rope {full.data}: Tunix Gemma 4 supports unscaled 'proportional' RoPE only")
    fraction = full.number("partial_rotary_factor", 1.0) if full.data.get("rope_type") == "proportional" else 1.0
    if not 0 < fraction <= 1:
        full.fail("partial_rotary_factor", fraction, "a fraction in (0, 1]")
    heads = cfg.integer("num_attention_heads")
    kv = _heads(cfg, heads, "num_key_value_heads", 1)
    ple = cfg.integer("hidden_size_per_layer_input", 0, minimum=0)
    vocab = cfg.integer("vocab_size")
    if ple and cfg.integer("vocab_size_per_layer_input", vocab) != vocab:
        raise SpecError(
            f"vocab_size_per_layer_input={cfg.data['vocab_size_per_layer_input']} differs from vocab_size={vocab}: "
            "Tunix Gemma 4 sizes its per-layer embedding by vocab_size"
        )
    shared = cfg.integer("num_kv_shared_layers", 0, minimum=0)
    if shared:
        _check_kv_sharing(layer_types, shared)
    moe = bool(cfg.data.get("enable_moe_block"))
    experts = cfg.integer("num_experts") if moe else 0
    per_token = cfg.integer("top_k_experts") if moe else 0
    if per_token > experts:
        raise SpecError(f"{cfg.source}: top_k_experts={per_token} is more than num_experts={experts}")
    head_dim = cfg.integer("head_dim", 256)
    global_head_dim, global_kv = _global_attention(cfg, layer_types, head_dim, kv)
    softcap = cfg.number("final_logit_softcapping", None)
    if softcap is not None and softcap <= 0:
        cfg.fail("final_logit_softcapping", softcap, "a positive number or null")
    return GemmaSpec(
        family="gemma4",
        num_layers=num_layers,
        hidden=cfg.integer("hidden_size"),
        mlp=cfg.integer("intermediate_size"),
        vocab=vocab,
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv,
        global_head_dim=global_head_dim,
        global_kv_heads=global_kv,
        sliding_window=cfg.integer("sliding_window"),
        layer_types=layer_types,
        k_eq_v=bool(cfg.data.get("attention_k_eq_v")),
        per_layer_input_dim=ple,
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(cfg.data.get("use_double_wide_mlp")) and shared > 0,
        num_experts=experts,
        experts_per_token=per_token,
        expert_dim=cfg.integer("moe_intermediate_size") if moe else 0,
        final_logit_softcap=softcap,
        norm="scale",
        local_rope_base=local.number("rope_theta", 10_000.0),
        global_rope_base=full.number("rope_theta", 1_000_000.0),
        global_rope_fraction=fraction,
    )


# What transformers assumes for a Gemma 4 config that names no global head width.
_HF_GLOBAL_HEAD_DIM = 512
_PER_LAYER_KEYS = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}


def _global_attention(cfg: Fields, layer_types: tuple[str, ...], head_dim: int, kv: int) -> tuple[int, int]:
    """``(global_head_dim, global_kv_heads)`` from either generation of Gemma 4 config.

    transformers before 5.15 writes ``global_head_dim`` and ``num_global_key_value_heads`` (the latter used on
    ``attention_k_eq_v`` layers only); from 5.15 it writes ``per_layer_config`` (``{"5": {"head_dim": 512,
    "num_key_value_heads": 4}}``), sparse overrides of the layer-wide fields. Where both appear they must agree.
    """
    heads = cfg.integer("num_attention_heads")
    legacy_kv = _heads(cfg, heads, "num_global_key_value_heads", kv) if cfg.data.get("attention_k_eq_v") else kv
    legacy = {"head_dim": cfg.integer("global_head_dim", _HF_GLOBAL_HEAD_DIM), "num_key_value_heads": legacy_kv}
    if cfg.data.get("per_layer_config") is None:
        return legacy["head_dim"], legacy["num_key_value_heads"]
    per_layer = cfg.mapping("per_layer_config")
    layer_wide = {"head_dim": head_dim, "num_key_value_heads": kv}
    found: dict[str, dict[str, int]] = {SLIDING: {}, GLOBAL: {}}
    for index, kind in enumerate(layer_types):
        raw = per_layer.get(str(index), per_layer.get(index))
        overrides = Fields(raw if raw is not None else {}, f"{cfg.source}: per_layer_config[{index!r}]", SpecError)
        unknown = sorted(set(overrides.data) - set(_PER_LAYER_KEYS))
        if unknown:
            raise SpecError(f"{overrides.source} overrides {unknown}; Tunix Gemma 4 varies only head_dim and "
                            "num_key_value_heads between layers")
        values = {key: overrides.integer(key, layer_wide[key]) for key in _PER_LAYER_KEYS}
        if kind == SLIDING and values != layer_wide:
            raise SpecError(f"{overrides.source}: a sliding layer with {values}; Tunix Gemma 4 gives sliding "
                            f"layers the layer-wide {layer_wide}")
        if found[kind] and values != found[kind]:
            raise SpecError(f"{overrides.source}: {values} differs from another global layer's {found[kind]}; "
                            "Tunix Gemma 4 gives every global layer the same attention widths")
        found[kind] = values
    extra = sorted(str(k) for k in per_layer if str(k) not in {str(i) for i in range(len(layer_types))})
    if extra:
        raise SpecError(f"{cfg.source}: per_layer_config names layers {extra}, outside num_hidden_layers="
                        f"{len(layer_types)}")
    values = found[GLOBAL] or layer_wide
    _heads(Fields(values, f"{cfg.source}: per_layer_config", SpecError), heads, "num_key_value_heads", kv)
    for key, legacy_key in _PER_LAYER_KEYS.items():
        if legacy_key in cfg.data and cfg.data[legacy_key] is not None and legacy[key] != values[key]:
            raise SpecError(f"{cfg.source}: {legacy_key}={legacy[key]} disagrees with per_layer_config's "
                            f"{key}={values[key]} on the global layers; write the config again with one of them")
    return values["head_dim"], values["num_key_value_heads"]


def _check_kv_sharing(layer_types: tuple[str, ...], shared: int) -> None:
    # Tunix lets shared global layers read the last unshared layer and shared sliding layers the one before it;
    # HF reads the last unshared layer of the same type. They agree only when the unshared part ends sliding, global.
    first = len(layer_types) - shared
    if first < 2 or layer_types[first - 2 : first] != (SLIDING, GLOBAL):
        raise SpecError(
            f"num_kv_shared_layers={shared}: the last two unshared layers ({first - 2}, {first - 1}) must be "
            "sliding then global for Tunix's KV sharing to match HF's"
        )


