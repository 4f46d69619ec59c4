"""``GemmaSpec`` -> the Tunix ``ModelConfig`` of ``tunix.models.gemma3`` or ``tunix.models.gemma4``."""

from __future__ import annotations

from typing import Any

from gemport._src.extras import require
from gemport.specs.spec import GLOBAL, SLIDING, GemmaSpec


def tunix_config(spec: GemmaSpec, *, param_dtype=None, compute_dtype=None, sharding=None):
    """See ``GemmaSpec.to_tunix``."""
    import jax.numpy as jnp  # JAX on first use: `import gemport.specs` stays cheap

    param_dtype = jnp.float32 if param_dtype is None else param_dtype
    if spec.family == "gemma3":
        return _gemma3_to_tunix(spec, param_dtype, sharding)
    return _gemma4_to_tunix(spec, param_dtype, compute_dtype or param_dtype, sharding)


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
    g3 = require("tunix.models.gemma3.model", "a Tunix Gemma 3 config")

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
    g4 = require("tunix.models.gemma4.model", "a Tunix Gemma 4 config")

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


