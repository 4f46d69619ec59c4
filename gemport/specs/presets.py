"""The published Gemma sizes as ``GemmaSpec`` presets."""

from gemport.specs.spec import GemmaSpec, layer_cycle


def _gemma3(num_layers, hidden, mlp, heads, kv, head_dim, window, vocab, query_scalar, rope_scale):
    return GemmaSpec(
        family="gemma3", num_layers=num_layers, hidden=hidden, mlp=mlp, vocab=vocab, num_heads=heads,
        head_dim=head_dim, num_kv_heads=kv, global_head_dim=head_dim, global_kv_heads=kv, sliding_window=window,
        layer_types=layer_cycle(num_layers, 6), norm="one_plus_scale", global_rope_scale=rope_scale,
        query_scale=query_scalar**-0.5,
    )  # fmt: skip


def _gemma4(num_layers, hidden, mlp, heads, kv, global_kv, window, period, **extra):
    return GemmaSpec(
        family="gemma4", num_layers=num_layers, hidden=hidden, mlp=mlp, vocab=262_144, num_heads=heads,
        head_dim=256, num_kv_heads=kv, global_head_dim=512, global_kv_heads=global_kv, sliding_window=window,
        layer_types=layer_cycle(num_layers, period), final_logit_softcap=30.0, global_rope_fraction=0.25, **extra,
    )  # fmt: skip


PRESETS = {
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
