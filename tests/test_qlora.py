"""QLoRA: bitsandbytes 4-bit NF4 bases (transformers + PEFT + TRL, run here on CPU) against Qwix NF4 on Tunix."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

from gemport import names
from gemport.checkpoint.quantize import dequantized, load_qlora_model, nf4, nf4_values, tile_shape, to_qarray
from gemport.errors import LoraError
from gemport.lora import LoraSpec, QLoraSpec, apply_lora
from gemport.specs import GemmaSpec
from tiny import hf_logits, randomize, token_ids

bnb_f = pytest.importorskip("bitsandbytes.functional")

NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="float32")

# Widths that bitsandbytes' 64-element blocks tile: o_proj's input (4 heads x 16) is one block per row on the
# split-q config, two heads of 32 per block on the k_eq_v one, and one 64-wide head per block on its global layer.
QLORA_CONFIGS = {
    "gemma3": tf.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=4),
    "gemma4": tf.Gemma4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                                  final_logit_softcapping=30.0),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Factory name -> saved float32 HF checkpoint directory of a QLORA_CONFIGS model."""
    cache = {}

    def make(name):
        if name not in cache:
            cfg = QLORA_CONFIGS[name]
            cfg._attn_implementation = "eager"
            cls = tf.Gemma4ForCausalLM if name == "gemma4" else tf.Gemma3ForCausalLM
            path = tmp_path_factory.mktemp(f"qlora-{name}")
            randomize(cls(cfg)).save_pretrained(path)
            cache[name] = path
        return cache[name]

    return make


def bnb_model(path, double_quant):
    """transformers + bitsandbytes' 4-bit model of ``path``, in train mode: bitsandbytes' CPU inference kernel
    (eval mode) computes in bfloat16 with bfloat16 scales, which no GPU recipe runs; training dequantizes in the
    compute dtype and multiplies, as on a GPU."""
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=tf.BitsAndBytesConfig(**NF4, bnb_4bit_use_double_quant=double_quant))
    return model.train()


def bnb_weights(model):
    """{HF weight name relative to the text prefix: bitsandbytes' dequantized float32 array}."""
    return {name.removeprefix("model.") + ".weight": bnb_f.dequantize_4bit(m.weight.data, m.weight.quant_state).numpy()
            for name, m in model.named_modules() if hasattr(getattr(m, "weight", None), "quant_state")}


# The config maps ------------------------------------------------------------------------------------------------


def test_bitsandbytes_config_its_dict_and_trl_fields_map_to_the_same_base(tmp_path):
    expected = QLoraSpec(double_quant=True, compute_dtype="bfloat16")
    bnb = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    assert QLoraSpec.from_config(bnb) == expected
    assert QLoraSpec.from_config(bnb.to_dict()) == expected
    # TRL's ModelConfig (and so a `trl sft --config` YAML): the compute dtype is the model's dtype.
    from trl import ModelConfig

    trl = ModelConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", use_bnb_nested_quant=True, dtype="bfloat16")
    assert QLoraSpec.from_config(trl) == expected
    assert QLoraSpec.from_config({"load_in_4bit": True, "use_bnb_nested_quant": True, "dtype": "bfloat16"}) == expected
    (tmp_path / "config.json").write_text(tf.Gemma3TextConfig(quantization_config=bnb.to_dict()).to_json_string())
    assert QLoraSpec.from_config(tmp_path) == expected
    assert QLoraSpec.from_config({"load_in_4bit": False}) is None
    assert QLoraSpec.from_config(ModelConfig()) is None
    assert QLoraSpec.from_config(tf.BitsAndBytesConfig(**QLoraSpec(compute_dtype="float32").to_bnb())) == QLoraSpec(
        compute_dtype="float32")


@pytest.mark.parametrize("fields, match", [
    ({"load_in_8bit": True}, "load_in_8bit=True: LLM.int8"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type='fp4'"),
    ({"load_in_4bit": True, "llm_int8_skip_modules": ["lm_head", "mlp.down_proj"]}, r"keeps \['down_proj'\]"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"load_in_4bit": True, "llm_int8_enable_fp32_cpu_offload": True}, "offload"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "int8"}, "compute dtype 'int8'"),
    ({"load_in_4bit": "yes"}, "load_in_4bit='yes' is not true or false"),
], ids=["int8", "fp4", "skip-projection", "gptq", "offload", "compute-dtype", "not-bool"])
def test_what_cannot_be_reproduced_is_refused_naming_the_field(fields, match):
    with pytest.raises(LoraError, match=match):
        QLoraSpec.from_config(fields)


# The quantizer against bitsandbytes' -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_codes_and_absmax_are_bitsandbytes(dtype):
    """gemport's NF4 of a weight dequantizes to bitsandbytes' exactly, with and without double quantization;
    double quantization itself moves the weights by about 0.3% of their largest value (measured here)."""
    assert np.array_equal(nf4_values(), bnb_f.get_4bit_type("nf4", device="cpu").numpy())
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0)).mul(0.05).to(dtype)
    w[3, :64] = 0.0  # an all-zero block
    for double_quant in (False, True):
        q, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        expected = bnb_f.dequantize_4bit(q, state).float().numpy()
        entry = names.Entry("w", ("w",), "f d -> d f", (("d", 192), ("f", 256)))
        mine = to_qarray(entry, [w.float().numpy()], QLoraSpec(double_quant=double_quant))
        got = (nf4_values()[np.asarray(mine.qvalue, np.uint8)] * np.repeat(mine.scale, 64, axis=0)).T
        got = torch.from_numpy(got).to(dtype).float().numpy()
        assert np.array_equal(got, expected), np.abs(got - expected).max()
    plain = bnb_f.dequantize_4bit(*bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")).float()
    shift = float((plain - torch.from_numpy(expected)).abs().max() / plain.abs().max())
    print(f"double quantization moves {dtype} weights by {shift:.2e} of their max |w|")
    assert 1e-4 < shift < 1e-2


def test_nf4_ties_round_to_the_lower_value():
    values = nf4_values()
    midpoints = (values[1:] + values[:-1]) / 2
    codes, absmax = nf4(np.concatenate([midpoints, [1.0] * (64 - 15)]), 64)
    assert absmax[0] == 1.0 and list(codes[:15]) == list(range(15))


def test_blocks_follow_the_hf_input_dimension_into_tunix_axes():
    spec = GemmaSpec.from_hf(QLORA_CONFIGS["gemma4"].to_dict())
    tiles = {e.tunix: tile_shape(e, 64) for e in names.entries(spec) if e.tunix.startswith("layers.")
             and e.tunix.endswith((".w", ".kernel"))}
    assert tiles["layers.0.attn.attn_vec_einsum.w"] == (2, 32, 1)  # two 32-wide heads per block
    assert tiles["layers.1.attn.attn_vec_einsum.w"] == (1, 64, 1)  # a 64-wide global head per block
    assert tiles["layers.1.attn.k_einsum.w"] == (1, 64, 1)
    assert tiles["layers.0.mlp.down_proj.kernel"] == (64, 1)
    narrow = GemmaSpec.from_hf(dataclasses.replace(spec, hidden=40).to_hf_config())
    (q,) = [e for e in names.entries(narrow) if e.tunix == "layers.0.attn.q_einsum.w"]
    with pytest.raises(LoraError, match=r"layers.0.self_attn.q_proj.weight: input dimension \(d=40\)"):
        tile_shape(q, 64)


# The loaded base and the forward pass ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double-quant"])
def test_loaded_base_is_bitsandbytes_dequantized_weights(base, name, double_quant):
    path = base(name)
    expected = bnb_weights(bnb_model(path, double_quant))
    model = load_qlora_model(path, QLoraSpec(double_quant=double_quant))
    got = dequantized(model)
    spec = GemmaSpec.from_hf(path)
    entries = [e for e in names.entries(spec) if e.tunix in got]
    assert {h for e in entries for h in e.hf} == set(expected)
    for e in entries:
        assert np.array_equal(got[e.tunix], e.to_tunix([expected[h] for h in e.hf])), e.tunix
    assert model.layers[0].attn.attn_vec_einsum.w.array.qvalue.dtype == jnp.uint4
