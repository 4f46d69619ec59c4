"""Tiny Gemma configs a 4-bit base is made of, for the QLoRA tests (the ``qlora_base`` fixture, tests/conftest.py)."""

import transformers as tf

# Widths that bitsandbytes' 64-element blocks tile: o_proj's input (4 heads x 16) is one block per row on the
# split-q config, two heads of 32 per block on the k_eq_v one, and one 64-wide head per block on its global layer.
QLORA_CONFIGS = {
    "gemma3": tf.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=4),
    "gemma4": tf.Gemma4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                                  final_logit_softcapping=30.0),
    # Tensors large enough that one of them, not the fixed cost of building a model, sets the host peak.
    "wide": tf.Gemma3TextConfig(vocab_size=96, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                                sliding_window=4),
}
