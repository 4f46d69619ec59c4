"""export_merged on disk: Orbax input, sharded multimodal bases (untouched bytes), and refusal of bad input."""

import json
import shutil
from types import SimpleNamespace

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tiny
from flax import nnx
from tunix.sft.checkpoint_manager import CheckpointManager

from gemport.checkpoint import (
    HFCheckpoint,
    export_merged,
    export_peft,
    import_peft,
    load_model,
    load_lora,
    save_lora_spec,
)
from gemport.checkpoint.output import write_sharded
from gemport.checkpoint.safetensors import SafetensorsFile, TensorSource, write_file
from gemport.errors import (
    CheckpointError,
    LoraError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsafePathError,
)
from gemport.lora import LoraSpec, apply_lora
from gemport.specs import GemmaSpec

LORA = LoraSpec(rank=4, alpha=8.0)
LORA_KEY = "layers.0.attn.q_einsum.w_lora_a"
VISION = {  # a q_proj in the vision tower too: an adapter on the text q_proj must not touch it
    "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.vision_tower.encoder.layers.0.mlp.fc1.weight": (32, 16),
    "model.embed_vision.embedding_projection.weight": (32, 16),
}


def raw(info):
    with open(info.file, "rb") as fh:
        fh.seek(info.start)
        return fh.read(info.nbytes)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    tiny.causal_lm("gemma4_dense").save_pretrained(root / "base")
    spec = GemmaSpec.from_hf(root / "base")
    model = apply_lora(load_model(root / "base"), spec, LORA)
    rng = np.random.default_rng(2)
    flat = [(p, v.replace(jnp.asarray(rng.normal(0, 0.2, v.get_value().shape), jnp.float32)))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    nnx.update(model, nnx.from_flat_state(flat))
    export_merged(model, root / "merged", base_dir=root / "base", lora_spec=LORA)
    return SimpleNamespace(root=root, spec=spec, model=model, params=load_lora(model, lora_spec=LORA).flat())


@pytest.fixture(scope="module")
def multimodal(run):
    """The base as a sharded multimodal checkpoint: text under model.language_model., plus vision tensors."""
    base = HFCheckpoint(run.root / "base")
    rng = np.random.default_rng(0)
    sources = [TensorSource.copy_of("model.language_model." + k.removeprefix("model."), base.info(k))
               for k in base.keys()]
    sources += [TensorSource.from_array(k, (lambda s=s: rng.normal(size=s).astype(ml_dtypes.bfloat16)),
                                        ml_dtypes.bfloat16, s) for k, s in VISION.items()]
    out = run.root / "multimodal"
    out.mkdir()
    write_sharded(out, sources, max_shard_size=20_000, desc="test")
    shutil.copy(run.root / "base/config.json", out)
    (out / "tokenizer.json").write_text("{}")
    return out


def test_orbax_checkpoint_exports_like_the_in_memory_model(run):
    root = run.root / "orbax"
    manager = CheckpointManager(str(root))
    earlier = nnx.from_flat_state([(p, v.replace(v.get_value() * 0)) for p, v in
                                   nnx.to_flat_state(nnx.state(run.model, nnx.LoRAParam))])
    stale = nnx.clone(run.model)
    nnx.update(stale, earlier)
    manager.save(1, stale, save_only_lora_params=True, force=True)
    manager.save(2, run.model, save_only_lora_params=True, force=True)
    manager.close()
    save_lora_spec(root, LORA)
    export_merged(root, run.root / "from_orbax", base_dir=run.root / "base")
    for name in ("model.safetensors", "config.json"):
        assert (run.root / "from_orbax" / name).read_bytes() == (run.root / "merged" / name).read_bytes()
    np.testing.assert_array_equal(load_lora(root, step=1).flat()[LORA_KEY], 0)


def test_sharded_multimodal_base_keeps_untouched_tensors_byte_identical(run, multimodal):
    out = run.root / "multimodal_merged"
    export_merged(run.model, out, base_dir=multimodal, lora_spec=LORA, max_shard_size=20_000)
    merged, base, text = HFCheckpoint(out), HFCheckpoint(multimodal), HFCheckpoint(run.root / "merged")
    assert len({i.file for i in base.tensors.values()}) > 2 and len({i.file for i in merged.tensors.values()}) > 2
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() == set(base.keys())
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    touched = 0
    for name in base.keys():
        same = raw(merged.info(name)) == raw(base.info(name))
        text_name = "model." + name.removeprefix("model.language_model.")
        is_lora = name.startswith("model.language_model.") and any(
            f".{p}." in name for p in LORA.targets)
        assert same != is_lora, name
        touched += is_lora
        if name.startswith("model.language_model."):
            assert raw(merged.info(name)) == raw(text.info(text_name)), name
    # q, o, gate, up, down per layer; k on every layer; v on sliding layers only (k_eq_v global layers)
    assert touched == 6 * run.spec.num_layers + len(run.spec.layers_of("sliding"))


def no_output(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


def with_change(params, key, value):
    return dict(params, **{key: value})


@pytest.mark.parametrize("change, error, match", [
    (lambda p: with_change(p, "layers.0.attn.q_einsum.w_lora_b", np.zeros((4, 4, 9), np.float32)),
     ShapeMismatchError, "w_lora_b.*\\[4, 4, 9\\].*\\[4, 4, 8\\]"),
    (lambda p: with_change(p, "layers.9.attn.q_einsum.w_lora_a", p[LORA_KEY]),
     UnexpectedTensorError, "layers.9.*different model"),
    (lambda p: {k: v for k, v in p.items() if "layers.3.mlp" not in k}, CheckpointError, "layers.3.mlp"),
    (lambda p: with_change(p, LORA_KEY, np.where(np.arange(4) == 2, np.nan, p[LORA_KEY])), LoraError, "NaN"),
    (lambda p: with_change(p, LORA_KEY, np.full_like(p[LORA_KEY], np.inf)), LoraError, "NaN or Inf"),
])
def test_bad_adapter_is_refused_without_output(run, change, error, match):
    out = run.root / "bad"
    with pytest.raises(error, match=match):
        export_merged(change(run.params), out, base_dir=run.root / "base", lora_spec=LORA)
    no_output(out)
    with pytest.raises(error, match=match):
        export_peft(change(run.params), out, spec=run.spec, lora_spec=LORA)
    no_output(out)


def test_wrong_rank_in_spec_is_refused(run):
    with pytest.raises(ShapeMismatchError, match="r=8"):
        export_merged(run.params, run.root / "bad", base_dir=run.root / "base", lora_spec=LoraSpec(8, 16.0))
    no_output(run.root / "bad")


def test_adapter_for_another_model_is_refused(run, tmp_path):
    tiny.causal_lm("gemma4_moe").save_pretrained(tmp_path / "other")
    with pytest.raises((ShapeMismatchError, UnexpectedTensorError)):
        export_merged(run.params, run.root / "bad", base_dir=tmp_path / "other", lora_spec=LORA)
    no_output(run.root / "bad")


def test_peft_export_of_a_multimodal_base_uses_its_text_prefix_and_imports_back(run, multimodal, tmp_path):
    export_peft(run.params, tmp_path / "adapter", base_dir=multimodal, lora_spec=LORA)
    keys = set(SafetensorsFile(tmp_path / "adapter/adapter_model.safetensors").tensors)
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(multimodal.resolve())
    back = import_peft(tmp_path / "adapter", base_dir=multimodal)
    assert back.lora_spec == LORA
    for key, value in back.flat().items():
        np.testing.assert_array_equal(value, run.params[key], err_msg=key)


def test_missing_base_shard_is_refused(run, multimodal, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(multimodal, broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        export_merged(run.params, tmp_path / "out", base_dir=broken, lora_spec=LORA)
    no_output(tmp_path / "out")


def test_output_inside_input_is_refused(run):
    with pytest.raises(UnsafePathError):
        export_merged(run.params, run.root / "base" / "merged", base_dir=run.root / "base", lora_spec=LORA)
    assert not (run.root / "base" / "merged").exists()


def test_missing_lora_spec_is_refused(run):
    # A model from apply_lora carries its spec; its bare LoRA state does not.
    with pytest.raises(LoraError, match="save_lora_spec"):
        export_merged(nnx.state(run.model, nnx.LoRAParam), run.root / "bad", base_dir=run.root / "base")
    no_output(run.root / "bad")


def test_import_refuses_broken_and_foreign_adapters(run, tmp_path):
    good = tmp_path / "good"
    export_peft(run.params, good, spec=run.spec, lora_spec=LORA)
    other = GemmaSpec.from_hf(tiny.text_config("gemma3_1b").to_dict())
    with pytest.raises((ShapeMismatchError, UnexpectedTensorError)):
        import_peft(good, spec=other)
    # export refuses NaN, so break a written adapter by hand
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    weights = bad / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    info = next(i for k, i in SafetensorsFile(weights).tensors.items() if k.endswith("q_proj.lora_A.weight"))
    data[info.start:info.start + 4] = np.float32(np.nan).tobytes()
    weights.write_bytes(bytes(data))
    with pytest.raises(LoraError, match="NaN"):
        import_peft(bad, spec=run.spec)


@pytest.mark.parametrize("change, error, match", [("alter", LoraError, "is not a copy of"),
                                                   ("drop", MissingTensorError, "without")])
def test_import_refuses_a_v_proj_copy_that_is_not_k_proj(run, tmp_path, change, error, match):
    """On a k_eq_v layer a v_proj can only repeat k_proj's factors (for vLLM): anything else is named."""
    export_peft(run.params, tmp_path / "good", spec=run.spec, lora_spec=LORA)
    key = f"base_model.model.model.layers.{run.spec.layers_of('global')[0]}.self_attn.v_proj.lora_B.weight"
    weights = SafetensorsFile(tmp_path / "good/adapter_model.safetensors")
    sources = [TensorSource.copy_of(k, info) for k, info in weights.tensors.items() if k != key]
    if change == "alter":
        info = weights.tensors[key]
        sources.append(TensorSource.from_array(key, lambda: weights.array(key) * 2, np.float32, info.shape))
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(tmp_path / "good/adapter_config.json", bad)
    write_file(bad / "adapter_model.safetensors", sources)
    with pytest.raises(error, match=match) as e:
        import_peft(bad, spec=run.spec)
    assert key in str(e.value)


def test_export_peft_warns_when_vllm_would_refuse_the_rank(run, tmp_path):
    with pytest.warns(UserWarning, match="vLLM"):
        export_peft(run.params, tmp_path / "rank4", spec=run.spec, lora_spec=LORA)
    config = json.loads((tmp_path / "rank4/adapter_config.json").read_text())
    assert config["r"] == 4 and config["modules_to_save"] is None and not config["rank_pattern"]


def test_missing_lora_checkpoint_is_named(run, tmp_path):
    with pytest.raises(CheckpointError, match="nothing.*PeftTrainer"):
        export_merged(tmp_path / "nothing", tmp_path / "out", base_dir=run.root / "base")
    no_output(tmp_path / "out")
