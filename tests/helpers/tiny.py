"""Tiny random Gemma models built with transformers, shared by the tests.

Every config differs from the others in head counts and head widths, and every sliding window (4) is
shorter than the test sequences (12 tokens), so a wrong mask or layout cannot hide.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers as tf

SEQ = 12

TEXT_CONFIGS = {
    # Gemma 4 31B layout: k_eq_v global layers with fewer, wider KV heads, 5:1 sliding pattern.
    "gemma4_dense": dict(
        model_type="gemma4_text", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
    ),
    # E2B/E4B-like: per-layer inputs, KV-shared trailing layers with double-wide MLPs, 4:1 pattern.
    "gemma4_ple": dict(
        model_type="gemma4_text", vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=4,
        layer_types=["sliding_attention"] * 4 + ["full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
        use_double_wide_mlp=True, final_logit_softcapping=30.0,
    ),
    # 26B-A4B-like: MoE beside the dense MLP, k_eq_v global layers.
    "gemma4_moe": dict(
        model_type="gemma4_text", vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=4, global_head_dim=8, num_global_key_value_heads=2,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=30.0,
    ),
    # Every head count divides a 2 x 4 (fsdp x tp) mesh, for sharded loading.
    "gemma4_mesh": dict(
        model_type="gemma4_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, global_head_dim=16, num_global_key_value_heads=4,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
    ),
    # Served by vLLM, whose CPU attention takes head widths 64 and 128 (not 8 or 16): the 31B layout again.
    "gemma4_vllm": dict(
        model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
    ),
    # E2B-like (per-layer inputs, KV-shared trailing layers with double-wide MLPs) with vLLM's head widths and the
    # test tokenizer's vocabulary, for `gemport sft` against TRL and the exports served by vLLM.
    "gemma4_e2b_vllm": dict(
        model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=128, sliding_window=4,
        layer_types=["sliding_attention"] * 4 + ["full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
        use_double_wide_mlp=True, final_logit_softcapping=30.0,
    ),
    # E4B-like: per-layer inputs, KV-shared trailing layers, MLPs of one width, 2 KV heads, 5:1 pattern; vLLM's head
    # widths, for `gemport sft` against TRL and the exports served by vLLM.
    "gemma4_e4b": dict(
        model_type="gemma4_text", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128, sliding_window=4,
        layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
        final_logit_softcapping=30.0,
    ),
    # 26B-A4B-like with vLLM's head widths: MoE beside the dense MLP, k_eq_v global layers, served merged by vLLM.
    "gemma4_moe_vllm": dict(
        model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0,
    ),
    "gemma3_vllm": dict(
        model_type="gemma3_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=4,
    ),
    # Gemma 3 1B-like: GQA with one KV head, queries scaled by head_dim.
    "gemma3_1b": dict(
        model_type="gemma3_text", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
    ),
    # Gemma 3 with as many KV heads as query heads (Tunix fuses qkv_einsum), queries scaled by D/N, linear RoPE.
    "gemma3_qkv": dict(
        model_type="gemma3_text", vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    ),
}


def text_config(name: str):
    kwargs = dict(TEXT_CONFIGS[name])
    model_type = kwargs.pop("model_type")
    cls = tf.Gemma4TextConfig if model_type == "gemma4_text" else tf.Gemma3TextConfig
    return cls(**kwargs)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (norms and layer scalars too) a random value of a realistic magnitude."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "embed_tokens" in name:
                # Smaller embeddings keep logits near 1, where float32 rounding differences stay below 1e-5.
                p.copy_(noise * 0.25 * p.shape[-1] ** -0.5)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * noise if "norm" in name or "scale" in name else 0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.75 + 0.5 * torch.rand(b.shape, generator=g))
    return model.eval()


def causal_lm(name: str, seed: int = 0):
    """A randomised ``Gemma3ForCausalLM`` / ``Gemma4ForCausalLM`` of config ``name``, in float32, eager attention."""
    cfg = text_config(name)
    cls = tf.Gemma4ForCausalLM if isinstance(cfg, tf.Gemma4TextConfig) else tf.Gemma3ForCausalLM
    cfg._attn_implementation = "eager"
    return randomize(cls(cfg), seed)


def conditional_generation(name: str, seed: int = 0):
    """A randomised ``Gemma3ForConditionalGeneration`` / ``Gemma4ForConditionalGeneration`` with a tiny vision tower.

    Its text part is config ``name``. transformers 5.12 saves Gemma 3's as ``language_model.model.*`` beside
    ``vision_tower.*``, and Gemma 4's as ``model.language_model.*`` beside ``model.vision_tower.*``.
    """
    text = text_config(name).to_dict()
    if text["model_type"] == "gemma4_text":
        vision = tf.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=2, head_dim=8)
        cfg, cls = tf.Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=None), \
            tf.Gemma4ForConditionalGeneration
    else:
        vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14)
        cfg, cls = tf.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4), \
            tf.Gemma3ForConditionalGeneration
    cfg._attn_implementation = "eager"
    cfg.get_text_config()._attn_implementation = "eager"
    return randomize(cls(cfg), seed)


def token_ids(vocab: int, batch: int = 2, seq: int = SEQ, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq)).astype(np.int32)


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def real_magnitudes(model: torch.nn.Module, seed: int = 0, max_logit: float = 120.0) -> torch.nn.Module:
    """Give a randomised model a real checkpoint's magnitudes, where miniatures' fixed tolerances fail.

    Layer norm gains from 1 to 10 with an outlier channel of 50 (Gemma 3 270M's range), a few embedding rows of
    8x the others' norm (as tokens real training leaves far from the rest), and the final norm scaled so that the
    largest logit (before Gemma 4's soft cap) is ``max_logit`` on ``token_ids``: real Gemma 3 logits pass 100,
    the tiny models' stay near 1.
    """
    g = torch.Generator().manual_seed(seed + 1)
    offset = 1.0 if isinstance(model.config.get_text_config(), tf.Gemma3TextConfig) else 0.0  # Gemma 3: (1 + w)
    text = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            # q_norm and k_norm stay near 1: gains of tens there would saturate every softmax (chaos, not scale).
            if p.ndim == 1 and "layernorm" in name and "pre_feedforward_layernorm_2" not in name:
                gain = 1.0 + 9.0 * torch.rand(p.shape, generator=g)
                gain[int(torch.randint(p.shape[0], (1,), generator=g))] = 50.0
                p.copy_(gain - offset)
        embedding = text.embed_tokens.weight
        rows = torch.randperm(embedding.shape[0], generator=g)[:3]
        embedding[rows] *= 8.0
        ids = torch.tensor(token_ids(embedding.shape[0]), dtype=torch.long)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        scale = max_logit / float((hidden @ embedding.T).abs().max())
        norm = text.norm.weight
        norm.copy_((norm + offset) * scale - offset)
    return model.eval()
