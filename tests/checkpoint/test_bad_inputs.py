"""Hostile but fair inputs: each gets a typed error naming the culprit (one line and exit 2 on the CLI), inputs
stay byte-identical, and no output that looks complete is left. Checkpoints as they sit in the Hugging Face hub
cache load, convert and export exactly as the plain folder."""

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from gemport_cli import gemport, one_line_error

from gemport import (
    CheckpointError,
    CorruptFileError,
    LoraError,
    MeshError,
    OptimizerConfigError,
    SpecError,
    UnsafePathError,
)
from gemport.checkpoint import (
    HFCheckpoint,
    export_merged,
    import_peft,
    load_hf,
    load_orbax,
    load_lora,
    save_hf,
    save_orbax,
)
from gemport.checkpoint import output as output_module
from gemport.lora import LoraLayout, LoraSpec
from gemport.mesh import make_mesh
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec

LORA = LoraSpec(rank=4, alpha=8.0)
SHARD = "40KB"


def tree_digest(root):
    """``{relative path: sha256}`` of every file under ``root`` (links followed), and every link's target."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, root)
            out[key] = hashlib.sha256(open(path, "rb").read()).hexdigest()
            if os.path.islink(path):
                out[key + " ->"] = os.readlink(path)
    return out


@contextlib.contextmanager
def unchanged(*roots):
    """Assert that nothing under ``roots`` changes."""
    before = [tree_digest(r) for r in roots]
    yield
    assert [tree_digest(r) for r in roots] == before


def no_output(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


def same_files(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def plain(hf_checkpoint, tmp_path_factory):
    """A tiny Gemma 4 saved in several safetensors shards with an index, as Gemma 3 >= 4B and Gemma 4 are."""
    model, _ = hf_checkpoint("gemma4_dense")
    path = tmp_path_factory.mktemp("plain") / "gemma"
    model.save_pretrained(path, max_shard_size=SHARD)
    assert (path / "model.safetensors.index.json").is_file()
    return path


def hub_layout(plain, root):
    """``plain`` as ``huggingface_hub.snapshot_download`` leaves it: ``models--org--name/snapshots/<rev>/<file>``,
    each a relative link to ``../../blobs/<sha256>``."""
    repo, revision = root / "models--google--gemma-tiny", "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in plain.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(f"../../blobs/{digest}")
    return snapshot


@pytest.fixture(scope="module")
def hub(plain, tmp_path_factory):
    return hub_layout(plain, tmp_path_factory.mktemp("hub"))


@pytest.fixture(scope="module")
def lora_params(plain):
    """Random non-zero Qwix LoRA params for the tiny model."""
    rng = np.random.default_rng(0)
    shapes = LoraLayout(GemmaSpec.from_hf(plain), LORA).shapes()
    return {name: rng.normal(0, 0.2, shape).astype(np.float32) for name, shape in shapes.items()}


# 1. The hub cache -------------------------------------------------------------------------------------------

def test_hub_cache_checkpoint_loads_converts_and_exports_as_the_plain_folder(plain, hub, lora_params, tmp_path):
    assert len({i.file for i in HFCheckpoint(hub).tensors.values()}) > 2
    spec = GemmaSpec.from_hf(hub)
    with unchanged(hub.parent.parent):
        from_hub, from_plain = load_hf(hub), load_hf(plain)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(from_hub), jax.tree.leaves(from_plain)))
        save_hf(from_hub, tmp_path / "hub_hf", spec=spec, base_dir=hub, max_shard_size=SHARD)
        save_hf(from_plain, tmp_path / "plain_hf", spec=spec, base_dir=plain, max_shard_size=SHARD)
        export_merged(lora_params, tmp_path / "hub_merged", base_dir=hub, lora_spec=LORA, max_shard_size=SHARD)
        export_merged(lora_params, tmp_path / "plain_merged", base_dir=plain, lora_spec=LORA, max_shard_size=SHARD)
    same_files(tmp_path / "hub_hf", tmp_path / "plain_hf")
    same_files(tmp_path / "hub_merged", tmp_path / "plain_merged")
    assert not any(p.is_symlink() for p in (tmp_path / "hub_merged").iterdir())


def test_hub_cache_links_that_leave_the_repository_are_refused(plain, tmp_path):
    snapshot = hub_layout(plain, tmp_path / "cache")
    shard = next(snapshot.glob("model-00002-*.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(os.path.relpath(outside, snapshot))
    with pytest.raises(UnsafePathError, match=rf"{shard.name}.*elsewhere\.safetensors.*blobs"):
        HFCheckpoint(snapshot)


def test_an_index_naming_a_blob_directly_is_refused(plain, tmp_path):
    snapshot = hub_layout(plain, tmp_path / "cache")
    index = snapshot / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    blob = os.readlink(snapshot / data["weight_map"]["model.norm.weight"])
    data["weight_map"]["model.norm.weight"] = blob
    index.unlink()
    index.write_text(json.dumps(data))
    with pytest.raises(UnsafePathError, match=r"model\.norm\.weight.*\.\./\.\./blobs.*outside"):
        HFCheckpoint(snapshot)


def test_outputs_inside_a_hub_cache_repository_are_refused(hub, lora_params):
    with unchanged(hub.parent.parent):
        for out in (hub / "merged", hub.parent.parent / "blobs" / "merged"):
            with pytest.raises(UnsafePathError, match="inside input"):
                export_merged(lora_params, out, base_dir=hub, lora_spec=LORA)


# 2, 3, 9, 10. The command line --------------------------------------------------------------------------------

@pytest.fixture
def dummies(tmp_path):
    """Inputs the CLI must refuse before reading them: an Orbax-looking folder, a LoRA root, a PEFT adapter."""
    (tmp_path / "orbax").mkdir()
    (tmp_path / "orbax" / "_METADATA").write_text("{}")
    (tmp_path / "lora" / "0" / "model_params").mkdir(parents=True)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(LORA.to_peft()))
    save_file({}, tmp_path / "adapter" / "adapter_model.safetensors")
    return tmp_path


def test_cli_writers_refuse_an_output_inside_any_input(plain, dummies):
    with unchanged(plain, dummies):
        one_line_error(gemport("export", plain, dummies / "lora", plain / "peft", "--format", "peft", ok=False),
                       "inside input", str(plain))
        one_line_error(gemport("import-peft", dummies / "adapter", plain, plain / "imported", ok=False),
                       "inside input", str(plain))
        one_line_error(gemport("convert", dummies / "orbax", plain / "hf", "--spec", plain, ok=False),
                       "inside input", str(plain))
    assert not (plain / "peft").exists() and not (plain / "imported").exists() and not (plain / "hf").exists()


def test_cli_convert_refuses_a_base_dir_of_another_model(plain, hf_checkpoint, tmp_path):
    other = hf_checkpoint("gemma3_1b")[1]
    save_orbax(load_hf(plain), tmp_path / "orbax")
    with unchanged(plain, other, tmp_path / "orbax"):
        one_line_error(gemport("convert", tmp_path / "orbax", tmp_path / "out", "--spec", plain, "--base-dir", other,
                               ok=False), str(other), "another model")
        one_line_error(gemport("convert", tmp_path / "orbax", tmp_path / "out", "--base-dir", other, ok=False),
                       "orbax", "shape")
    no_output(tmp_path / "out")


def test_cli_convert_names_a_missing_config_and_plan_refuses_nonsense(plain, tmp_path):
    folder = tmp_path / "weights"
    shutil.copytree(plain, folder)
    (folder / "config.json").unlink()
    one_line_error(gemport("convert", folder, tmp_path / "out", ok=False), "without config.json")
    (tmp_path / "file").write_text("a file, not a folder")
    one_line_error(gemport("convert", plain, tmp_path / "file" / "out", ok=False), "cannot write", "file/out")
    one_line_error(gemport("plan", "gemma4-31b", "--devices", "0", ok=False), "0 devices")
    one_line_error(gemport("plan", "gemma4-31b", "--devices", "4", "--lora-rank", "-1", ok=False), "--lora-rank -1")
    no_output(tmp_path / "out")


def test_cli_bad_config_json_is_one_line(plain, tmp_path):
    folder = tmp_path / "gemma"
    shutil.copytree(plain, folder)
    (folder / "config.json").write_bytes(b'{"model_type": "gemma4_text", "name": "\xff"}')
    with unchanged(folder):
        one_line_error(gemport("convert", folder, tmp_path / "out", ok=False), "config.json", "UTF-8")
    no_output(tmp_path / "out")


# 4. PEFT options -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [
    ("alora_invocation_tokens", [106, 107]),
    ("exclude_modules", ["layers.0.self_attn.q_proj"]),
    ("trainable_token_indices", [5, 6]),
    ("lora_bias", True),
    ("layer_replication", [[0, 4], [2, 6]]),
    ("use_qalora", True),
])
def test_peft_options_that_change_the_model_are_refused(option, value):
    with pytest.raises(LoraError, match=option):
        LoraSpec.from_peft(dict(LORA.to_peft(), **{option: value}))


def test_peft_numbers_are_checked_and_a_dict_without_peft_type_is_lora():
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "k_proj"]}
    assert LoraSpec.from_peft(config) == LoraSpec(4, 8.0, ("q_proj", "k_proj", "v_proj"))
    for bad, match in [(dict(config, r=4.7), "r=4.7"), (dict(config, r="4"), "r='4'"), (dict(config, r=0), "r=0"),
                       (dict(config, lora_alpha="big"), "lora_alpha"), (dict(config, lora_alpha=math.nan), "lora_alpha"),
                       ({"lora_alpha": 8, "target_modules": ["q_proj"]}, "'r' is missing"),
                       ({"r": 8, "target_modules": ["q_proj"]}, "'lora_alpha' is missing"),
                       (dict(config, lora_dropout=1.5), "lora_dropout"), (dict(config, peft_type="IA3"), "IA3")]:
        with pytest.raises(LoraError, match=match):
            LoraSpec.from_peft(bad)


def test_import_peft_names_a_broken_adapter_config(dummies, plain):
    spec = GemmaSpec.from_hf(plain)
    config = dummies / "adapter" / "adapter_config.json"
    for text, match in [("{not json", "not valid JSON"), ("[1, 2]", "JSON array"),
                        (json.dumps({"lora_alpha": 8, "target_modules": ["q_proj"]}), "'r' is missing"),
                        (json.dumps(dict(LORA.to_peft(), alora_invocation_tokens=[106])), "aLoRA")]:
        config.write_text(text)
        with unchanged(dummies / "adapter"), pytest.raises(LoraError, match=rf"adapter_config\.json.*{match}"):
            import_peft(dummies / "adapter", spec=spec)


# 5, 6. Orbax -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def orbax_checkpoint(plain, tmp_path_factory):
    return save_orbax(load_hf(plain), tmp_path_factory.mktemp("orbax") / "ckpt")


def test_orbax_outputs_on_unwritable_paths_fail_at_once_naming_the_path(plain, tmp_path):
    state = load_hf(plain)
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'file' / 'out'}.*cannot write"):
        save_orbax(state, tmp_path / "file" / "out")
    with mounted(tmp_path / "ro", "ro,size=1m"):
        with pytest.raises(CheckpointError, match=r"ro/out.*Read-only file system"):
            save_orbax(state, tmp_path / "ro" / "out")


def test_damaged_orbax_checkpoints_are_named(plain, orbax_checkpoint, tmp_path):
    spec = GemmaSpec.from_hf(plain)
    no_metadata = tmp_path / "no_metadata"
    shutil.copytree(orbax_checkpoint, no_metadata)
    (no_metadata / "_METADATA").unlink()
    with pytest.raises(CorruptFileError, match=rf"{no_metadata}.*_METADATA"):
        load_orbax(no_metadata, spec=spec)
    lora_root = tmp_path / "lora"
    shutil.copytree(no_metadata, lora_root / "3" / "model_params")
    with pytest.raises(CorruptFileError, match="_METADATA"):
        load_lora(lora_root, lora_spec=LORA)
    garbled = tmp_path / "garbled"
    shutil.copytree(orbax_checkpoint, garbled)
    for path in garbled.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"\x00garbage" * 64)
    with unchanged(garbled), pytest.raises(CorruptFileError, match=str(garbled)):
        load_orbax(garbled, spec=spec)


def test_a_broken_lora_spec_file_is_named(tmp_path):
    (tmp_path / "0" / "model_params").mkdir(parents=True)
    for text in ("{broken", "[]", json.dumps({"rank": 4}), json.dumps({"rank": -1, "alpha": 1, "targets": []})):
        (tmp_path / "gemport_lora.json").write_text(text)
        with pytest.raises(LoraError, match=r"gemport_lora\.json.*save_lora_spec"):
            load_lora(tmp_path / "0")


# 7. JSON, safetensors, meshes, optimizer ----------------------------------------------------------------------

@pytest.fixture
def copy(plain, tmp_path):
    path = tmp_path / "gemma"
    shutil.copytree(plain, path)
    return path


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("content, match", [
    (b"[1, 2, 3]", "JSON array, not an object"),
    (b'{"model_type": "gemma4_text", "x": "\xff\xfe"}', "not UTF-8"),
])
def test_config_json_that_is_not_an_object_or_not_utf8(copy, content, match):
    (copy / "config.json").write_bytes(content)
    with pytest.raises(SpecError, match=rf"config\.json.*{match}"):
        GemmaSpec.from_hf(copy)


@pytest.mark.parametrize("change, match", [
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_attention_heads": "4"}, "num_attention_heads='4' is not an integer"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_size": 32.5}, "hidden_size=32.5"),
    ({"layer_types": "sliding_attention"}, "layer_types"),
    ({"rope_parameters": [1]}, "rope_parameters"),
    ({"sliding_window": -4}, "sliding_window=-4"),
])
def test_config_values_of_the_wrong_type_or_range(change, match):
    from tiny import TEXT_CONFIGS

    with pytest.raises(SpecError, match=match):
        GemmaSpec.from_hf(dict(TEXT_CONFIGS["gemma3_1b"], **change))


def header_edit(path, edit):
    """Rewrite a safetensors header in place (same length, padded), data untouched."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n :])


def first_shard(path):
    return sorted(path.glob("model-0000*.safetensors"))[0]


def some_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("edit, error, match", [
    (lambda h: h[some_tensor(h)].update(data_offsets=["0", "4"]), CorruptFileError, "not integers"),
    (lambda h: h[some_tensor(h)].update(data_offsets=[0.0, 4.5]), CorruptFileError, "not integers"),
    (lambda h: h[some_tensor(h)].update(data_offsets=[-4, 0]), CorruptFileError, "negative"),
    (lambda h: h[some_tensor(h)].update(dtype="U32"), CheckpointError, "U32, valid in safetensors but not one"),
])
def test_safetensors_headers_with_bad_offsets_or_unread_dtypes(copy, edit, error, match):
    shard = first_shard(copy)
    header_edit(shard, edit)
    with pytest.raises(error, match=rf"{shard.name}.*{match}") as caught:
        load_hf(copy)
    if error is CheckpointError:
        assert not isinstance(caught.value, CorruptFileError)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(weight_map=list(d["weight_map"])), "weight_map=.*is not a JSON object"),
    (lambda d: d["weight_map"].update({"model.norm.weight": None}), "model.norm.weight.*maps to None"),
    (lambda d: d["weight_map"].pop("model.norm.weight"), "holds 'model.norm.weight'.*does not map"),
])
def test_index_that_is_malformed_or_misses_a_tensor(copy, edit, match):
    edit_json(copy / "model.safetensors.index.json", edit)
    with pytest.raises(CorruptFileError, match=rf"index\.json.*{match}"):
        load_hf(copy)


def test_an_integer_tensor_where_a_float_weight_belongs(copy):
    shard = first_shard(copy)
    header_edit(shard, lambda h: h[some_tensor(h)].update(dtype="I32"))
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*is I32, but a Gemma weight is a float"):
        load_hf(copy)


def test_nan_in_base_weights_is_named(copy, lora_params, tmp_path):
    from safetensors.numpy import load_file

    shard = next(p for p in copy.glob("model-*.safetensors") if "model.layers.0.self_attn.q_proj.weight" in
                 load_file(p))
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = np.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    state = load_hf(copy)
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*NaN"):
        save_hf(state, tmp_path / "converted", spec=GemmaSpec.from_hf(copy))
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*NaN"):
        export_merged(lora_params, tmp_path / "merged", base_dir=copy, lora_spec=LORA)


def test_mesh_sizes_are_checked():
    spec = GemmaSpec.preset("gemma4-31b")
    for sizes, match in [(dict(tp=0), "tp=0"), (dict(tp=-1), "tp=-1"), (dict(fsdp=0), "fsdp=0"),
                         (dict(tp=8), "tp=8 does not divide the 4 devices")]:
        with pytest.raises(MeshError, match=match):
            make_mesh(spec, devices=jax.devices()[:4], **sizes)


@pytest.mark.parametrize("args, match", [
    ({"learning_rate": -1e-4}, "learning_rate=-0.0001 is out of range"),
    ({"learning_rate": math.nan}, "learning_rate must be a finite number"),
    ({"adam_beta1": 1.5}, "adam_beta1=1.5"),
    ({"adam_epsilon": -1e-8}, "adam_epsilon"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"max_grad_norm": math.nan}, "max_grad_norm"),
])
def test_optimizer_values_torch_refuses(args, match):
    with pytest.raises(OptimizerConfigError, match=match):
        hf_optimizer(args, num_training_steps=100)


def test_optimizer_arguments_of_the_wrong_kind():
    for bad in ("2e-4", ["learning_rate", 1e-4], None):
        with pytest.raises(OptimizerConfigError, match="neither TrainingArguments nor a dict"):
            hf_optimizer(bad, num_training_steps=100)
    for steps in ("100", 0, 2.5, True):
        with pytest.raises(OptimizerConfigError, match="num_training_steps"):
            hf_optimizer({}, num_training_steps=steps)


# 7, 10. Writing: full disks, races, killed runs -----------------------------------------------------------------

@contextlib.contextmanager
def mounted(path, options):
    """A tmpfs at ``path`` (``mount -t tmpfs``); skips the test where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_is_named_and_leaves_nothing(plain, lora_params, tmp_path):
    with mounted(tmp_path / "disk", "size=64k") as disk, unchanged(plain):
        with pytest.raises(CheckpointError, match=rf"{disk / 'merged'}.*No space left on device"):
            export_merged(lora_params, disk / "merged", base_dir=plain, lora_spec=LORA)
        assert list(disk.iterdir()) == []
        with pytest.raises(CheckpointError, match=rf"{disk / 'orbax'}.*No space left on device"):
            save_orbax(load_hf(plain), disk / "orbax")
        assert list(disk.iterdir()) == []


def test_a_write_error_is_named_and_leaves_nothing(plain, lora_params, tmp_path, monkeypatch):
    def full(path, sources, metadata=None):
        open(path, "wb").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output_module, "write_file", full)
    with unchanged(plain), pytest.raises(CheckpointError, match=rf"{tmp_path / 'merged'}.*No space left on device"):
        export_merged(lora_params, tmp_path / "merged", base_dir=plain, lora_spec=LORA)
    no_output(tmp_path / "merged")


def test_two_runs_racing_for_one_output(plain, tmp_path, monkeypatch):
    state, spec, out = load_hf(plain), GemmaSpec.from_hf(plain), tmp_path / "out"
    real = output_module.write_file
    calls = []

    def other_run_finishes_first(path, sources, metadata=None):
        if not calls:
            calls.append(path)
            save_hf(state, out, spec=spec)  # the rival passes check_output too: out does not exist yet
        return real(path, sources, metadata)

    monkeypatch.setattr(output_module, "write_file", other_run_finishes_first)
    with pytest.raises(CheckpointError, match=rf"output {out} appeared while this run was writing it"):
        save_hf(state, out, spec=spec, max_shard_size=SHARD)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


KILLED_EXPORT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from gemport.checkpoint import export_merged
    from gemport.checkpoint import output
    from gemport.lora import LoraSpec

    real = output.write_file

    def stall_after_the_first_shard(path, sources, metadata=None):
        written = real(path, sources, metadata)
        time.sleep(600)
        return written

    output.write_file = stall_after_the_first_shard
    base, params, out = sys.argv[1:]
    export_merged(dict(np.load(params)), out, base_dir=base, lora_spec=LoraSpec(rank=4, alpha=8.0),
                  max_shard_size="40KB")
""")


def test_a_killed_export_is_cleaned_up_by_the_next_run(plain, lora_params, tmp_path):
    np.savez(tmp_path / "params.npz", **lora_params)
    out = tmp_path / "exports" / "merged"
    child = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(plain), str(tmp_path / "params.npz"), str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list(out.parent.glob(".merged.partial-*/model-00001-of-*.safetensors")):
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the export never wrote its first shard"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stderr.close()
    (partial,) = out.parent.iterdir()
    assert partial.name.startswith(".merged.partial-") and not out.exists()

    export_merged(lora_params, out, base_dir=plain, lora_spec=LORA, max_shard_size=SHARD)
    assert [p.name for p in out.parent.iterdir()] == ["merged"]
    export_merged(lora_params, tmp_path / "reference", base_dir=plain, lora_spec=LORA, max_shard_size=SHARD)
    same_files(out, tmp_path / "reference")


def test_partial_outputs_of_live_runs_and_other_hosts_are_kept(tmp_path):
    out = tmp_path / "merged"
    live = tmp_path / f".merged.partial-{output_module._HOST}-{os.getpid()}-abcd1234"
    elsewhere = tmp_path / ".merged.partial-another-host-1-abcd1234"
    for path in (live, elsewhere):
        path.mkdir()
    assert output_module.remove_stale_partials(out) == []
    assert live.is_dir() and elsewhere.is_dir()


def test_save_hf_refuses_a_state_of_another_model_at_a_base_dir(plain, hf_checkpoint, tmp_path):
    other = hf_checkpoint("gemma3_1b")[1]
    with pytest.raises(SpecError, match=rf"base_dir {other} is another model"):
        save_hf(load_hf(plain), tmp_path / "out", spec=GemmaSpec.from_hf(plain), base_dir=other)
    no_output(tmp_path / "out")

