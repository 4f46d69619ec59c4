"""A TPU host needs no torch: gemport's commands in a Python where torch, TRL, PEFT and accelerate cannot be
imported (``tests/helpers/no_torch_child.py``), as after ``pip install 'gemport[tpu]'``.

The checkpoints and data are made here, with the full stack; the commands run in the child: ``gemport sft`` on
the bundled recipe (examples/sft_verilog.yaml, on a miniature) with its merged export, its dry run, ``gemport
plan``, ``gemport dpo``, ``gemport convert`` and ``gemport export``; the commands that need a peer (``parity``:
TRL and PEFT; ``verify`` against transformers' model: torch) refuse at once, naming the extra. The tokens and
masks the child's tokenizer path gives (transformers without torch) are the full stack's.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import transformers
from dpo_command import write_recipe as write_dpo_recipe
from repo_paths import HELPERS, ROOT

from gemport.data import from_sft_config
from gemport.data.training_template import gemma4_training_template

RECIPE = ROOT / "examples" / "sft_verilog.yaml"
DATA = ROOT / "examples" / "data" / "verilog_chat.jsonl"


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    """examples/sft_verilog.py's miniature of Gemma 4 31B, with a template that marks the trained turns."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from port_gemma4 import tiny_checkpoint
    finally:
        sys.path.pop(0)
    base = tmp_path_factory.mktemp("no-torch") / "base"
    tiny_checkpoint(base, [json.loads(line)["messages"] for line in DATA.read_text().splitlines()])
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = gemma4_training_template()
    tokenizer.save_pretrained(base)
    return base


@pytest.fixture(scope="module")
def child(miniature, dpo_workdir, tmp_path_factory):
    work = tmp_path_factory.mktemp("no-torch-run")
    out, dpo_out = work / "sft", work / "dpo"
    sft = ["sft", "--config", str(RECIPE), "--model_name_or_path", str(miniature), "--dtype", "float32",
           "--max_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--dataset_name", str(DATA)]
    plan = {
        "commands": [
            [*sft, "--output_dir", str(out), "--merge"],
            [*sft, "--output_dir", str(work / "dry"), "--dry-run"],
            ["plan", "gemma4-31b", "--tpu", "v5p-8", "--lora-rank", "16", "--batch", "8", "--seq-len", "2048"],
            ["dpo", "--config", str(write_dpo_recipe(work / "dpo.yaml", dpo_workdir, max_steps=2, bf16=False,
                                                     logging_steps=1, use_peft=True, lora_r=4, lora_alpha=8,
                                                     lora_target_modules=["q_proj", "v_proj"])),
             "--output_dir", str(dpo_out)],
            ["convert", str(miniature), str(work / "orbax")],
            ["export", str(miniature), str(out / "checkpoints"), str(work / "exported")],
            ["parity", str(miniature), str(DATA), "--config", str(RECIPE), "--steps", "1"],
            ["verify", str(out / "merged"), "--base", str(miniature)],
        ],
        "tokenize": {"records": str(DATA), "recipe": {"assistant_only_loss": True, "max_length": 384},
                     "base": str(miniature)},
    }
    (work / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run([sys.executable, str(HELPERS / "no_torch_child.py"), str(work / "plan.json"),
                           str(work / "result.json")], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((work / "result.json").read_text())
    return work, {tuple(c["argv"][:1]) + (("--dry-run",) if "--dry-run" in c["argv"] else ()): c
                  for c in result["commands"]}, result


def test_training_planning_and_exports_run_without_torch_trl_peft_or_accelerate(child):
    work, commands, result = child
    for name in [("sft",), ("sft", "--dry-run"), ("plan",), ("dpo",), ("convert",), ("export",)]:
        assert commands[name]["status"] in (0, None), (name, commands[name]["last"])
    assert (work / "sft" / "adapter_model.safetensors").is_file()
    assert (work / "sft" / "merged" / "config.json").is_file()
    assert (work / "sft" / "trainer_state.json").is_file() and (work / "dpo" / "trainer_state.json").is_file()
    assert (work / "exported").is_dir() and (work / "orbax").is_dir()
    assert result["imported"] == []


def test_commands_that_need_a_peer_refuse_naming_the_extra(child):
    _, commands, _ = child
    assert commands[("parity",)]["status"] not in (0, None)
    assert "pip install 'gemport[parity]'" in commands[("parity",)]["last"], commands[("parity",)]["last"]
    assert commands[("verify",)]["status"] not in (0, None)
    assert "pip install 'gemport[hf]'" in commands[("verify",)]["last"], commands[("verify",)]["last"]


def test_tokens_and_masks_without_torch_are_the_full_stacks(child, miniature):
    _, _, result = child
    tokenizer = transformers.AutoTokenizer.from_pretrained(miniature)
    examples, _ = from_sft_config({"assistant_only_loss": True, "max_length": 384}, tokenizer).examples(
        str(DATA), tokenizer, progress=False)
    assert len(examples) == len(result["tokens"]) > 100
    for e, tokens, mask in zip(examples, result["tokens"], result["loss_mask"]):
        np.testing.assert_array_equal(e.tokens, tokens)
        np.testing.assert_array_equal(e.loss_mask, mask)
