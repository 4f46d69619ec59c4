"""GemmaSpec from HF configs and presets, and its Tunix configs."""

import dataclasses

import pytest
import transformers as tf
from tiny import TEXT_CONFIGS, text_config
from tunix.models.gemma3 import model as g3
from tunix.models.gemma4 import model as g4

from gemport import SpecError
from gemport.specs import GemmaSpec
from repo_paths import FILES

PRESETS = ("gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b", "gemma4-e2b", "gemma4-e4b", "gemma4-31b",
           "gemma4-26b-a4b")


def test_presets_cover_the_published_sizes():
    assert set(PRESETS) <= set(GemmaSpec.presets())


def test_gemma4_31b_preset():
    spec = GemmaSpec.preset("gemma4-31b")
    assert (spec.num_layers, spec.hidden, spec.mlp, spec.vocab) == (60, 5376, 21504, 262144)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 16, 256)
    assert (spec.global_kv_heads, spec.global_head_dim, spec.k_eq_v) == (4, 512, True)
    assert spec.layers_of("global") == tuple(range(5, 60, 6))
    assert spec.final_logit_softcap == 30.0 and spec.tied_embeddings


@pytest.mark.parametrize(
    "preset,tunix",
    [("gemma4-31b", g4.ModelConfig.gemma4_31b), ("gemma4-e4b", g4.ModelConfig.gemma4_e4b),
     ("gemma4-e2b", g4.ModelConfig.gemma4_e2b), ("gemma4-26b-a4b", g4.ModelConfig.gemma4_26b_a4b)],
)
def test_gemma4_presets_agree_with_tunix_presets(preset, tunix):
    ours, theirs = GemmaSpec.preset(preset).to_tunix(), tunix()
    for field in ("num_layers", "num_embed", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads",
                  "sliding_window_size", "per_layer_input_dim", "k_eq_v_global", "num_experts", "expert_dim",
                  "num_experts_per_tok", "final_logit_softcap", "override_kv_shared_ffw_hidden"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_global_kv_heads or ours.num_kv_heads) == (theirs.num_global_kv_heads or theirs.num_kv_heads)
    num_layers = theirs.num_layers
    shared = lambda c: num_layers - int(num_layers - c.frac_shared_layers * num_layers)  # noqa: E731
    assert shared(ours) == shared(theirs)
    pattern = [theirs.attention_pattern[i % len(theirs.attention_pattern)] for i in range(num_layers)]
    assert list(ours.attention_pattern) == pattern


def test_gemma3_27b_preset_agrees_with_tunix():
    ours, theirs = GemmaSpec.preset("gemma3-27b").to_tunix(), g3.ModelConfig.gemma3_27b_pt()
    for field in ("num_layers", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads",
                  "sliding_window_size", "query_pre_attn_norm", "global_scale_factor", "global_base_frequency"):
        assert getattr(ours, field) == getattr(theirs, field), field


@pytest.mark.parametrize("name", sorted(TEXT_CONFIGS))
def test_from_hf_reads_transformers_configs(name):
    cfg = text_config(name)
    spec = GemmaSpec.from_hf(cfg.to_dict())
    assert spec.num_layers == cfg.num_hidden_layers and spec.num_heads == cfg.num_attention_heads
    assert spec.layer_types == tuple("global" if t == "full_attention" else "sliding" for t in cfg.layer_types)
    assert GemmaSpec.from_hf(spec.to_hf_config()) == spec


def test_from_hf_reads_the_text_part_of_multimodal_configs():
    text = text_config("gemma4_dense").to_dict()
    spec = GemmaSpec.from_hf({"model_type": "gemma4", "text_config": text, "vision_config": {}})
    assert spec == GemmaSpec.from_hf(text)


def test_from_hf_reads_legacy_gemma3_rope_keys():
    legacy = {
        "model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 32, "intermediate_size": 48,
        "vocab_size": 96, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
        "query_pre_attn_scalar": 8, "sliding_window": 4, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    spec = GemmaSpec.from_hf(legacy)
    assert (spec.global_rope_base, spec.local_rope_base, spec.global_rope_scale) == (1e6, 1e4, 8.0)
    modern = tf.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"}).to_dict()
    assert GemmaSpec.from_hf(modern) == spec


GEMMA4 = sorted(name for name, fields in TEXT_CONFIGS.items() if fields["model_type"] == "gemma4_text")


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_widths_are_those_of_the_installed_transformers(name, tmp_path):
    """config.json as the installed transformers writes it gives each layer the widths its model builds."""
    cfg = text_config(name)
    cfg.save_pretrained(tmp_path)
    spec = GemmaSpec.from_hf(tmp_path)
    model = tf.Gemma4ForCausalLM(cfg)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert spec.layer_head_dim(i) == attn.head_dim == attn.q_proj.out_features // cfg.num_attention_heads, i
        if hasattr(attn, "k_proj"):
            assert spec.layer_kv_heads(i) * attn.head_dim == attn.k_proj.out_features, i


def test_gemma4_config_files_of_both_generations_read_alike():
    # Stored as transformers 5.12 (global_head_dim, num_global_key_value_heads) and 5.24 (per_layer_config) wrote
    # the same gemma4_dense config.
    older = GemmaSpec.from_hf(FILES / "gemma4_config_5.12.json")
    newer = GemmaSpec.from_hf(FILES / "gemma4_config_5.24.json")
    assert older == newer
    assert (older.head_dim, older.num_kv_heads, older.global_head_dim, older.global_kv_heads) == (8, 2, 16, 1)
    written = GemmaSpec.from_hf(older.to_hf_config())
    assert written == older
    assert GemmaSpec.from_hf({k: v for k, v in older.to_hf_config().items() if k != "per_layer_config"}) == older
    assert GemmaSpec.from_hf({k: v for k, v in older.to_hf_config().items()
                              if k not in ("global_head_dim", "num_global_key_value_heads")}) == older


def test_a_gemma4_config_without_global_widths_takes_transformers_default():
    fields = {k: v for k, v in TEXT_CONFIGS["gemma4_dense"].items() if k != "global_head_dim"}
    assert GemmaSpec.from_hf(fields).global_head_dim == 512 == tf.Gemma4TextConfig(
        **{k: v for k, v in fields.items() if k != "model_type"}).to_dict().get("global_head_dim", 512)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"per_layer_config": {"5": {"head_dim": 32, "num_key_value_heads": 1}}}, "global_head_dim=16 disagrees"),
        ({"per_layer_config": {"5": {"head_dim": 16, "num_key_value_heads": 2}}},
         "num_global_key_value_heads=1 disagrees"),
        ({"per_layer_config": {"0": {"head_dim": 16}, "5": {"head_dim": 16}}}, r"per_layer_config\[0\]: a sliding"),
        ({"per_layer_config": {"5": {"head_dim": 16, "sliding_window": 8}}}, "overrides.*sliding_window"),
        ({"per_layer_config": {"5": {"head_dim": 16}, "9": {"head_dim": 16}}}, r"layers \['9'\]"),
        ({"per_layer_config": {"5": {"head_dim": "wide"}}}, r"per_layer_config\[5\].*head_dim='wide'"),
        ({"per_layer_config": {"5": {"num_key_value_heads": 3}}}, "not a multiple of num_key_value_heads=3"),
        ({"per_layer_config": [16]}, "per_layer_config"),
    ],
)
def test_inconsistent_gemma4_per_layer_configs_are_errors(change, message):
    cfg = dict(TEXT_CONFIGS["gemma4_dense"], **change)
    if "disagrees" not in message:
        cfg = {k: v for k, v in cfg.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    with pytest.raises(SpecError, match=message):
        GemmaSpec.from_hf(cfg)


def test_gemma4_global_layers_must_share_their_widths():
    cfg = dict(TEXT_CONFIGS["gemma4_ple"], per_layer_config={"4": {"head_dim": 32}, "6": {"head_dim": 64}})
    cfg.pop("global_head_dim")
    with pytest.raises(SpecError, match="per_layer_config\\[6\\].*differs from another global layer"):
        GemmaSpec.from_hf(cfg)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_bidirectional_attention": "all"}, "causal"),
        ({"hidden_activation": "silu"}, "GELU"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 4.0}}}, "rope"),
        ({"vocab_size_per_layer_input": 5}, "vocab_size_per_layer_input"),
        ({"num_kv_shared_layers": 1}, "sliding then global"),
    ],
)
def test_unsupported_gemma4_features_are_errors(change, message):
    cfg = dict(TEXT_CONFIGS["gemma4_ple"], **change)
    with pytest.raises(SpecError, match=message):
        GemmaSpec.from_hf(cfg)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"query_pre_attn_scalar": 100}, "query_pre_attn_scalar"),
        ({"final_logit_softcapping": 30.0}, "softcap"),
        ({"attn_logit_softcapping": 50.0}, "softcap"),
        ({"layer_types": ["full_attention"] * 6}, "5 sliding : 1 global"),
    ],
)
def test_unsupported_gemma3_features_are_errors(change, message):
    with pytest.raises(SpecError, match=message):
        GemmaSpec.from_hf(dict(TEXT_CONFIGS["gemma3_1b"], **change))


def test_other_models_and_bad_inputs_are_errors(tmp_path):
    with pytest.raises(SpecError, match="llama"):
        GemmaSpec.from_hf({"model_type": "llama"})
    with pytest.raises(SpecError, match="no config.json"):
        GemmaSpec.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        GemmaSpec.from_hf(tmp_path)
    with pytest.raises(SpecError, match="unknown preset"):
        GemmaSpec.preset("gemma5-1t")
    with pytest.raises(SpecError, match="layer_types"):
        dataclasses.replace(GemmaSpec.preset("gemma4-31b"), num_layers=59)


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GemmaSpec.preset("gemma3-1b").num_layers = 3


def test_a_layout_string_is_parsed_into_dimensions():
    from gemport.specs import names
    from gemport._src.pattern import Pattern, shape, words

    p = Pattern.parse("s (k h) d -> s k d h")
    assert p.left == (("s",), ("k", "h"), ("d",)) and p.right == (("s",), ("k",), ("d",), ("h",))
    assert p.letters == {"s", "k", "h", "d"} and Pattern.parse("s (k h) d -> s k d h") is p
    assert shape(p.left, {"s": 2, "k": 4, "h": 8, "d": 16}) == (2, 32, 16) and words(p.left) == ("s", "kh", "d")
    assert p.sizes_for({"k": 4, "x": 1}) == {"k": 4}
    for entry in names.entries(GemmaSpec.preset("gemma4-31b")):
        assert len(entry.tunix_shape) == len(entry.pattern.right)
    for bad in ("s (k h d -> s", "a -> b -> c", "n, d -> d"):
        with pytest.raises(SpecError, match="layout"):
            Pattern.parse(bad)
    assert p.inverse == "s k d h -> s (k h) d"


def test_an_einsum_equation_is_parsed_once():
    from gemport._src.pattern import Equation

    e = Equation.parse("BTD, NDH -> BTNH")
    assert (e.inputs, e.output) == (("BTD", "NDH"), "BTNH") and Equation.parse("BTD, NDH -> BTNH") is e
    assert e.letters == set("BTDNH")
    for bad in ("BTD,NDH", "a->b->c"):
        with pytest.raises(SpecError, match="einsum"):
            Equation.parse(bad)


@pytest.mark.parametrize("preset", GemmaSpec.presets())
def test_every_layout_letter_is_in_the_axis_alphabet(preset):
    from gemport.specs import names

    for entry in names.entries(GemmaSpec.preset(preset)):
        assert entry.pattern.letters <= set(names.AXES), entry.tunix
