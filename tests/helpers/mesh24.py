"""``MESH24``: Gemma 4 31B's layout at widths a 2x4 (fsdp, tp) mesh divides, and its randomised transformers model."""

import tiny
import transformers

# Gemma 4 31B's layout (k_eq_v global layer) with every tp-sharded dimension divisible by 4 and D by 2:
# 8 query heads, 4 KV heads on both layer types, head widths 8 and 16, MLP 64, vocabulary 128.
MESH24 = dict(
    model_type="gemma4_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"], num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    global_head_dim=16, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=4,
    hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
)  # fmt: skip


def mesh24_causal_lm():
    """A randomised Gemma4ForCausalLM of MESH24, built as tiny.py builds its configs."""
    kwargs = {k: v for k, v in MESH24.items() if k != "model_type"}
    cfg = transformers.Gemma4TextConfig(**kwargs)
    cfg._attn_implementation = "eager"
    return tiny.randomize(transformers.Gemma4ForCausalLM(cfg))
