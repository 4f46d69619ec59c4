"""Gemma 4's mixture of experts in the Tunix model gemport builds equals transformers' (gemport._src.moe).

MoE miniatures of several expert counts and top k, with and without k_eq_v global layers, every parameter random
(pre_feedforward_layernorm_2's weights too, which Tunix 0.1.7's own routing needs constant).
"""

import float64
import numpy as np
import pytest
import tiny
import transformers as tf
from flax import nnx
from tunix.models.gemma4 import model as g4

from gemport.checkpoint import load_hf, load_model
from gemport.specs import GemmaSpec
from gemport.check.verify import tunix_logits

VARIANTS = {
    "8x2": dict(num_experts=8, top_k_experts=2),  # the miniature: 8 experts, top 2, k_eq_v
    "6x3-no-k_eq_v": dict(num_experts=6, top_k_experts=3, attention_k_eq_v=False, num_global_key_value_heads=None),
    "5x1": dict(num_experts=5, top_k_experts=1),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_checkpoint(request, tmp_path_factory):
    """(transformers model, saved directory) of the MoE miniature ``gemma4_moe`` with the variant's fields."""
    fields = {k: v for k, v in tiny.TEXT_CONFIGS["gemma4_moe"].items() if k != "model_type"} | VARIANTS[request.param]
    cfg = tf.Gemma4TextConfig(**fields)
    cfg._attn_implementation = "eager"
    model = tiny.randomize(tf.Gemma4ForCausalLM(cfg), seed=len(request.param))
    path = tmp_path_factory.mktemp(f"moe-{request.param}")
    model.save_pretrained(path)
    return model, path


def test_moe_logits_equal_transformers_at_the_float32_floor(moe_checkpoint):
    """Within 10x transformers' own float32 distance from its float64 logits (tests/helpers/float64.py); Tunix 0.1.7's
    own routing, on the same weights, is not (checked on one variant: the miniatures can tell them apart)."""
    model, path = moe_checkpoint
    ids = tiny.token_ids(model.config.vocab_size)
    exact = float64.torch_logits(tf.Gemma4ForCausalLM, path, ids)
    float64.assert_float32_close(tunix_logits(load_model(path), ids), tiny.hf_logits(model, ids), exact)
    if model.config.num_experts != 8:
        return
    spec = GemmaSpec.from_hf(path)
    graphdef, state = nnx.split(g4.Gemma4(spec.to_tunix(), rngs=nnx.Rngs(0)))
    nnx.update(state, load_hf(path))
    tunix_own = tunix_logits(nnx.merge(graphdef, state), ids)
    with pytest.raises(AssertionError, match="float32 floor"):
        float64.assert_float32_close(tunix_own, tiny.hf_logits(model, ids), exact)
