"""Bad checkpoints get typed errors that name the culprit; outputs are atomic; inputs are never modified."""

import dataclasses
import json
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from gemport import (
    CheckpointError,
    CorruptFileError,
    GemportError,
    MissingTensorError,
    ShapeMismatchError,
    SpecError,
    UnexpectedTensorError,
    UnsafePathError,
)
from gemport.checkpoint import load_hf, save_hf
from gemport.checkpoint import save as save_module
from gemport.specs import GemmaSpec


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    """A private copy of a tiny Gemma 4 checkpoint, safe to damage."""
    _, path = hf_checkpoint("gemma4_dense")
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    return copy


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_every_error_is_a_gemport_error():
    for cls in (CheckpointError, CorruptFileError, MissingTensorError, ShapeMismatchError, SpecError,
                UnexpectedTensorError, UnsafePathError):
        assert issubclass(cls, GemportError)


def test_config_that_does_not_match_the_weights(ckpt):
    edit_config(ckpt, intermediate_size=64)
    with pytest.raises(ShapeMismatchError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\[48, 32\].*\[64, 32\]"):
        load_hf(ckpt)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.3.self_attn.v_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.3\.self_attn\.v_proj\.weight.*kv_einsum"):
        load_hf(ckpt)


def test_unknown_tensor(ckpt):
    def add_v_proj_to_k_eq_v_layer(t):
        t["model.layers.5.self_attn.v_proj.weight"] = t["model.layers.5.self_attn.k_proj.weight"]

    edit_tensors(ckpt, add_v_proj_to_k_eq_v_layer)
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.5\.self_attn\.v_proj\.weight"):
        load_hf(ckpt)


def test_truncated_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptFileError, match=r"model\.safetensors.*past the end"):
        load_hf(ckpt)


def test_corrupt_header(ckpt):
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[8:12] = b"#!@$"
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=r"model\.safetensors.*not valid JSON"):
        load_hf(ckpt)


def test_header_lying_about_a_tensor_size(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["model.norm.weight"]["shape"] = [33]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    (ckpt / "model.safetensors").write_bytes(data[:8] + raw[:n] + data[8 + n :])
    with pytest.raises(CorruptFileError, match=r"model\.norm\.weight.*needs"):
        load_hf(ckpt)


def _shard(ckpt, weight_map):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_naming_a_missing_shard(ckpt):
    keys = load_file(ckpt / "model.safetensors").keys()
    _shard(ckpt, {k: "model-00001-of-00001.safetensors" for k in keys} | {"model.norm.weight": "model-00002.safetensors"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*model-00002\.safetensors.*missing"):
        load_hf(ckpt)


def test_index_pointing_outside_the_checkpoint(ckpt, tmp_path):
    keys = load_file(ckpt / "model.safetensors").keys()
    shutil.copy(ckpt / "model.safetensors", tmp_path / "elsewhere.safetensors")
    _shard(ckpt, {k: "../elsewhere.safetensors" for k in keys})
    with pytest.raises(UnsafePathError, match=r"\.\./elsewhere\.safetensors.*outside"):
        load_hf(ckpt)


def test_output_equal_to_or_inside_the_input(ckpt):
    state = load_hf(ckpt)
    spec = GemmaSpec.from_hf(ckpt)
    for out in (ckpt, ckpt / "merged"):
        with pytest.raises(UnsafePathError, match="input"):
            save_hf(state, out, spec=spec, base_dir=ckpt)


def test_output_that_already_holds_files(ckpt, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        save_hf(load_hf(ckpt), tmp_path / "out", spec=GemmaSpec.from_hf(ckpt))
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_interrupted_save_leaves_nothing(ckpt, tmp_path, monkeypatch):
    calls = []
    real = save_module._hf_tensor

    def failing(entry, array, i):
        make = real(entry, array, i)

        def fail_on_the_fifth():
            calls.append(entry.tunix)
            if len(calls) == 5:
                raise KeyboardInterrupt
            return make()

        return fail_on_the_fifth

    monkeypatch.setattr(save_module, "_hf_tensor", failing)
    with pytest.raises(KeyboardInterrupt):
        save_hf(load_hf(ckpt), tmp_path / "out", spec=GemmaSpec.from_hf(ckpt), max_shard_size="40KB")
    assert list(tmp_path.iterdir()) == [ckpt]


def test_state_that_does_not_match_the_spec(ckpt, tmp_path):
    state = load_hf(ckpt)
    spec = GemmaSpec.from_hf(ckpt)
    other = dataclasses.replace(spec, num_layers=7, layer_types=spec.layer_types + ("global",))
    with pytest.raises(MissingTensorError, match=r"layers\.6"):
        save_hf(state, tmp_path / "out", spec=other)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    with pytest.raises(CheckpointError, match="safe_serialization"):
        load_hf(tmp_path, spec=GemmaSpec.preset("gemma3-1b"))
