"""HF <-> Tunix checkpoint bridge against real transformers and Tunix models."""

import json
import shutil

import float64
import jax
import numpy as np
import pytest
import transformers as tf
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from safetensors import safe_open
from tiny import TEXT_CONFIGS, hf_logits, token_ids

from gemport.specs import names
from gemport.checkpoint import HFCheckpoint, load_hf, load_model, save_hf
from gemport._src.params import abstract_model, path_str
from gemport.specs import GemmaSpec
from gemport.check.verify import tunix_logits
from repo_paths import FILES

CASES = [(name, "causal") for name in TEXT_CONFIGS] + [("gemma4_dense", "conditional"), ("gemma3_qkv", "conditional")]


def assert_logits_equal(got, model, path, ids):
    """Tunix's float32 logits within 10x the distance of transformers' own float32 logits from its float64 ones
    (no float32 step, tests/helpers/float64.py): float32's noise floor for this model, measured on this machine."""
    float64.assert_float32_close(got, hf_logits(model, ids), float64.torch_logits(type(model), path, ids))


def tensors(directory) -> dict[str, bytes]:
    ckpt = HFCheckpoint(directory)
    return {k: ckpt.array(k).tobytes() for k in ckpt.keys()}


@pytest.mark.parametrize("name,kind", CASES)
def test_tunix_logits_equal_transformers(hf_checkpoint, name, kind):
    model, path = hf_checkpoint(name, kind)
    ids = token_ids(model.config.get_text_config().vocab_size)
    tunix = load_model(path)
    assert_logits_equal(tunix_logits(tunix, ids), model, path, ids)


@pytest.mark.parametrize("generation", ["5.12", "5.24"])
def test_gemma4_loads_under_the_config_of_either_transformers_generation(hf_checkpoint, tmp_path, generation):
    # The weights are laid out alike; only config.json changed (5.15 moved the global widths to per_layer_config).
    model, path = hf_checkpoint("gemma4_dense")
    for file in path.iterdir():
        if file.name != "config.json":
            shutil.copy(file, tmp_path)
    (tmp_path / "config.json").write_bytes((FILES / f"gemma4_config_{generation}.json").read_bytes())
    ids = token_ids(model.config.vocab_size)
    np.testing.assert_allclose(tunix_logits(load_model(tmp_path), ids), hf_logits(model, ids), atol=1e-5, rtol=0)


def test_older_gemma3_multimodal_layout_loads(hf_checkpoint, tmp_path):
    """transformers writes Gemma 3 multimodal as ``language_model.model.*``; newer files use ``model.language_model.*``."""
    model, path = hf_checkpoint("gemma3_qkv", "conditional")
    assert names.detect_prefix(HFCheckpoint(path).keys()) == "language_model.model."
    renamed = {}
    with safe_open(path / "model.safetensors", "np") as f:
        for k in f.keys():
            new = k.replace("language_model.model.", "model.language_model.")
            renamed[new if new != k else "model." + k] = f.get_tensor(k)
    from safetensors.numpy import save_file

    save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert names.detect_prefix(HFCheckpoint(tmp_path).keys()) == "model.language_model."
    ids = token_ids(96)
    assert_logits_equal(tunix_logits(load_model(tmp_path), ids), model, path, ids)


SPECS = {name: lambda name=name: GemmaSpec.from_hf(dict(TEXT_CONFIGS[name])) for name in TEXT_CONFIGS}
SPECS.update({name: lambda name=name: GemmaSpec.preset(name) for name in GemmaSpec.presets()})


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rule_table_covers_exactly_the_tunix_tree(name):
    spec = SPECS[name]()
    _, state = nnx.split(abstract_model(spec))
    tunix = {path_str(p): v.get_value().shape for p, v in nnx.to_flat_state(state)}
    rules = {e.tunix: e.tunix_shape for e in names.entries(spec)}
    assert sorted(rules) == sorted(tunix)
    assert rules == tunix


@pytest.mark.parametrize("name,kind", CASES)
def test_round_trip_is_bit_identical(hf_checkpoint, tmp_path, name, kind):
    model, path = hf_checkpoint(name, kind)
    spec = GemmaSpec.from_hf(path)
    out = save_hf(load_hf(path), tmp_path / "out", spec=spec, base_dir=path, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert tensors(out) == tensors(path)
    reloaded, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_save_without_base_generates_a_loadable_config(hf_checkpoint, tmp_path):
    model, path = hf_checkpoint("gemma4_ple")
    spec = GemmaSpec.from_hf(path)
    out = save_hf(load_hf(path), tmp_path / "out", spec=spec)
    assert GemmaSpec.from_hf(out) == spec
    reloaded, info = tf.Gemma4ForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = token_ids(96)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(model, ids))


def test_sharded_load_carries_tunix_default_shardings(hf_checkpoint):
    model, path = hf_checkpoint("gemma4_mesh")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    state = load_hf(path, mesh=mesh)
    annotations = {
        path_str(p): v.get_metadata().get("out_sharding") or ()
        for p, v in nnx.to_flat_state(nnx.split(abstract_model(GemmaSpec.from_hf(path)))[1])
    }
    sharded = 0
    for p, v in nnx.to_flat_state(state):
        array = v.get_value()
        expected = NamedSharding(mesh, PartitionSpec(*annotations[path_str(p)]))
        assert array.sharding.is_equivalent_to(expected, array.ndim), path_str(p)
        sharded += any(annotations[path_str(p)])
    assert sharded > 0
    with jax.set_mesh(mesh):
        tunix = load_model(path, mesh=mesh)
        ids = token_ids(128, batch=2)
        assert_logits_equal(tunix_logits(tunix, ids), model, path, ids)


def test_load_casts_to_the_requested_dtype(hf_checkpoint):
    import jax.numpy as jnp

    _, path = hf_checkpoint("gemma3_1b")
    state = load_hf(path, param_dtype=jnp.bfloat16)
    assert {a.dtype for a in jax.tree.leaves(state)} == {jnp.dtype(jnp.bfloat16)}


def test_inputs_are_not_modified(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("gemma4_dense", "conditional")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    save_hf(load_hf(path), tmp_path / "out", spec=GemmaSpec.from_hf(path), base_dir=path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_config_json_of_generated_checkpoint_is_valid(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("gemma3_qkv")
    out = save_hf(load_hf(path), tmp_path / "out", spec=GemmaSpec.from_hf(path))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["dtype"] == "float32"
