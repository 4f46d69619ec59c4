"""The ``gemport`` command line on tiny checkpoints, failure paths included.

Commands run in this process through ``gemport.cli.main`` (what ``python -m gemport`` calls), so each does not
pay for importing JAX, torch and transformers again; ``test_the_entry_point_runs_as_a_subprocess`` covers the
real entry point.
"""

import copy
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from gemport.checkpoint import HFCheckpoint
from gemport_cli import gemport, one_line_error

COMMANDS = ("plan", "convert", "export", "import-peft", "verify", "peft-for-vllm")


@pytest.fixture(scope="module")
def base(hf_checkpoint):
    return hf_checkpoint("gemma4_dense")[1]


@pytest.fixture(scope="module")
def adapter(hf_checkpoint, tmp_path_factory):
    """A PEFT adapter with non-zero lora_A and lora_B on every projection of the tiny Gemma 4."""
    from peft import LoraConfig, get_peft_model

    model, _ = hf_checkpoint("gemma4_dense")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"])
    peft_model = get_peft_model(type(model)(model.config).eval(), config)
    peft_model.base_model.model.load_state_dict(model.state_dict(), strict=False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    path = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(path)
    return path


def test_the_entry_point_runs_as_a_subprocess():
    result = subprocess.run([sys.executable, "-m", "gemport", "plan", "gemma9-1t", "--devices", "8"],
                            capture_output=True, text=True, timeout=600)
    one_line_error(result, "unknown preset")
    assert "COMMAND" in subprocess.run([sys.executable, "-m", "gemport", "--help"], capture_output=True, text=True,
                                       timeout=600).stdout


def test_help_shows_the_library_defaults_it_does_not_repeat():
    import inspect

    from gemport.checkpoint import save_hf
    from gemport.check.verify import compare_logits, compare_vllm

    def default(function, name):
        return str(inspect.signature(function).parameters[name].default)

    assert f"(default {default(save_hf, 'max_shard_size')})" in gemport("convert", "--help").stdout
    shown = " ".join(gemport("verify", "--help").stdout.split())
    for function, name in ((compare_logits, "seq_len"), (compare_logits, "within"), (compare_vllm, "num_prompts"),
                           (compare_vllm, "max_tokens"), (compare_vllm, "dtype"), (compare_vllm, "within")):
        assert f"(default {default(function, name)}" in shown, name


def test_every_command_has_help():
    assert "COMMAND" in gemport("--help").stdout
    for command in COMMANDS:
        assert "usage: gemport " + command in gemport(command, "--help").stdout


def test_plan_lists_the_valid_meshes_and_what_fits():
    out = gemport("plan", "gemma4-31b", "--devices", "8", "--hbm", "v6e", "--lora-rank", "16").stdout
    assert "3 valid (fsdp, tp) meshes on 8 devices" in out
    assert "fsdp=2 tp=4" in out and "tp=8" not in out and "fits" in out


def test_plan_counts_the_train_step_with_batch_and_seq_len():
    out = gemport("plan", "gemma4-31b", "--devices", "4", "--hbm", "v5p", "--lora-rank", "16", "--batch", "4",
                  "--seq-len", "1024", "--remat", "decoder").stdout
    assert "activations" in out and "batch 4 x 1024 tokens, remat decoder" in out and out.count(": fits") == 3
    out = gemport("plan", "gemma4-31b", "--devices", "4", "--hbm", "v5p", "--lora-rank", "16").stdout
    assert "no batch/seq_len given" in out and ": fits" not in out
    one_line_error(gemport("plan", "gemma4-31b", "--devices", "4", "--batch", "4", ok=False), "--seq-len")


def test_plan_failures():
    one_line_error(gemport("plan", "gemma9-1t", "--devices", "8", ok=False), "unknown preset", "gemma4-31b")
    assert gemport("plan", "gemma4-31b", ok=False).returncode == 2


def test_convert_round_trip(base, tmp_path):
    gemport("convert", base, tmp_path / "orbax")
    gemport("convert", tmp_path / "orbax", tmp_path / "hf", "--base-dir", base, "--max-shard-size", "100KB")
    original, back = HFCheckpoint(base), HFCheckpoint(tmp_path / "hf")
    assert sorted(original.keys()) == sorted(back.keys())
    assert all(original.array(k).tobytes() == back.array(k).tobytes() for k in original.keys())


def test_convert_failures(base, tmp_path):
    (tmp_path / "orbax").mkdir()
    one_line_error(gemport("convert", tmp_path / "orbax", tmp_path / "out", ok=False), "Orbax", "--spec")
    one_line_error(gemport("convert", base, base / "inside", ok=False), "inside", str(base))
    one_line_error(gemport("convert", tmp_path / "missing", tmp_path / "out", ok=False), "missing",
                   "no such directory")


@pytest.fixture(scope="module")
def checkpoint(base, adapter, tmp_path_factory):
    """The GPU adapter imported as a PeftTrainer-style checkpoint."""
    out = tmp_path_factory.mktemp("imported") / "checkpoint"
    assert "rank 4, alpha 8.0, fused separate" in gemport("import-peft", adapter, base, out).stdout
    return out


def test_export_and_verify(base, checkpoint, tmp_path):
    gemport("export", base, checkpoint, tmp_path / "merged")
    gemport("export", base, checkpoint, tmp_path / "peft", "--format", "peft")
    assert "logits agree" in gemport("verify", base).stdout
    for export in ("merged", "peft"):
        result = gemport("verify", tmp_path / export, "--base", base, "--lora", checkpoint)
        assert "logits agree" in result.stdout


def test_verify_reports_disagreement(base, checkpoint):
    result = gemport("verify", base, "--lora", checkpoint, ok=False)
    assert result.returncode == 1 and "DISAGREE" in result.stdout


def test_verify_judges_a_real_scale_checkpoint_against_its_floor(real_checkpoint, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, real = real_checkpoint("gemma3_1b")  # logits past 100: a fixed atol of 1e-4 called this load wrong
    for dtype in ("float32", "bfloat16"):
        result = gemport("verify", real, "--dtype", dtype)
        assert "logits agree" in result.stdout and "x the floor" in result.stdout, result.stdout
    assert gemport("verify", real, "--atol", "1e-9", ok=False).returncode == 1  # a fixed atol, chosen explicitly

    # A trained adapter (B non-zero) through import and a merged export agrees in both dtypes.
    torch.manual_seed(0)  # PEFT's A
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    gemport("import-peft", tmp_path / "adapter", real, tmp_path / "checkpoint")
    gemport("export", real, tmp_path / "checkpoint", tmp_path / "merged")
    lora = ("--base", real, "--lora", tmp_path / "checkpoint")
    for dtype in ("float32", "bfloat16"):
        assert "logits agree" in gemport("verify", tmp_path / "merged", *lora, "--dtype", dtype).stdout

    # The export with one tensor corrupted exits 1: one layer's up_proj rows out of order (gate and up no longer
    # pair up) in float32; in bfloat16, whose floor on this miniature is a tenth of the logits, every token
    # reading its neighbour's embedding.
    def corrupt(name, tensor, fn):
        out = tmp_path / name
        shutil.copytree(tmp_path / "merged", out)
        shard = next(out.glob("*.safetensors"))
        tensors = safetensors.torch.load_file(shard)
        tensors[tensor] = fn(tensors[tensor]).contiguous()
        safetensors.torch.save_file(tensors, shard, metadata={"format": "pt"})
        return out

    up = corrupt("up", "model.layers.0.mlp.up_proj.weight", lambda w: w[torch.randperm(w.shape[0], generator=generator)])
    embedding = corrupt("embedding", "model.embed_tokens.weight", lambda w: w.roll(1, 0))
    for export, dtype in ((up, "float32"), (embedding, "float32"), (embedding, "bfloat16")):
        result = gemport("verify", export, *lora, "--dtype", dtype, ok=False)
        assert result.returncode == 1 and "DISAGREE" in result.stdout, result.stdout


def test_export_and_verify_failures(base, adapter, tmp_path):
    one_line_error(gemport("export", base, tmp_path / "nothing", tmp_path / "out", ok=False), "nothing")
    one_line_error(gemport("verify", adapter, ok=False), "PEFT adapter", "--base")
    one_line_error(gemport("import-peft", adapter, "gemma4-31b", tmp_path / "out", ok=False),
                   "adapter_model.safetensors", "q_proj.lora_A.weight", "expected [4, 5376]")
    assert not (tmp_path / "out").exists()


def test_peft_for_vllm_adds_the_v_proj_copies_and_changes_nothing_else(base, adapter, tmp_path):
    """A PEFT adapter made with save_pretrained gains k_proj's factors as v_proj on the k_eq_v layers; every other
    byte is the input's, and PEFT computes bit for bit the same logits with it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gemport.checkpoint.safetensors import SafetensorsFile, read_array
    from gemport.specs import GemmaSpec

    k_eq_v = GemmaSpec.from_hf(base).layers_of("global")
    assert f"v_proj copies of k_proj on {len(k_eq_v)} k_eq_v layers" in gemport("peft-for-vllm", adapter, base,
                                                                              tmp_path / "served").stdout
    src, out = (SafetensorsFile(d / "adapter_model.safetensors") for d in (adapter, tmp_path / "served"))
    added = set(out.tensors) - set(src.tensors)
    assert added == {f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_{x}.weight" for i in k_eq_v
                     for x in "AB"}
    for key, info in src.tensors.items():
        assert read_array(out.tensors[key]).tobytes() == read_array(info).tobytes(), key
    for key in added:
        assert read_array(out.tensors[key]).tobytes() == src.array(key.replace("v_proj", "k_proj")).tobytes(), key
    assert (tmp_path / "served/adapter_config.json").read_bytes() == (adapter / "adapter_config.json").read_bytes()
    ids = torch.arange(12).reshape(1, 12) * 7 % 96
    logits = []
    for d in (adapter, tmp_path / "served"):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), d).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(*logits)
    assert "nothing added" in gemport("peft-for-vllm", tmp_path / "served", base, tmp_path / "again").stdout


def test_verify_engine_vllm_without_vllm_says_how_to_install_it(base, adapter, tmp_path):
    args = ["verify", adapter, "--base", base, "--engine", "vllm", "--vllm-python"]
    one_line_error(gemport(*args, sys.executable, ok=False), "needs vllm", "make vllm")
    one_line_error(gemport(*args, tmp_path / "no-python", ok=False), "cannot run", "make vllm")


def test_continuations_are_judged_against_a_floor_or_a_chosen_atol():
    """`compare_continuations` has no default tolerance: a multiple of a floor measured on the tokens, or a fixed
    atol given on purpose."""
    import numpy as np

    from gemport.check.vllm_offline import Served
    from gemport.errors import VerifyError
    from gemport.check.verify import compare_continuations, compare_logits, compare_vllm, log_softmax

    reference = log_softmax(np.array([[[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]]]))  # one prompt token, one served token
    served = Served(np.array([[2]]), [[{2: float(reference[0, 0, 2]) + 1e-6}]], "engine")
    with pytest.raises(VerifyError, match="within= and floor="):
        compare_continuations(served, reference, name="reference")
    with pytest.raises(VerifyError, match="pass floor="):
        compare_continuations(served, reference, name="reference", within=10)
    assert compare_continuations(served, reference, name="reference", floor=2e-7, within=10).ok
    assert not compare_continuations(served, reference, name="reference", floor=5e-8, within=10).ok
    # A dtype verify does not compare in is refused, typed, before anything loads or serves.
    for compare in (lambda: compare_logits("no-such-dir", None, dtype="float16"),
                    lambda: compare_vllm("no-such-dir", dtype="float16")):
        with pytest.raises(VerifyError, match="float16.*float32 or bfloat16"):
            compare()
    assert not compare_continuations(served, reference, name="reference", atol=1e-7).ok
