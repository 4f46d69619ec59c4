"""E2B- and E4B-shaped Gemma 4 end to end: `gemport sft` (the command line) trains as TRL's SFTTrainer + PEFT,
and what it writes (the PEFT adapter in output_dir, `--merge`'s merged/) reads back in PEFT and transformers.

The miniatures carry what sets these sizes apart: per-layer inputs, KV-shared trailing layers, and (E2B)
double-wide MLPs in the shared layers. vLLM serving of both miniatures' exports is in tests/check/test_vllm.py
(``gemma4_e2b_vllm`` and ``gemma4_e4b``, the configs here, exported by the functions `gemport sft` calls).
"""

import json
import os
import shutil
import subprocess
import sys

import datasets
import numpy as np
import peft
import pytest
import torch
import transformers
import yaml
from float64 import TorchFloat64, relative, trajectory_bound
from trl import SFTConfig, SFTTrainer

from chats import chats, tokenizer
from sft_recipe import CONFIG, float64_logs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]


def peft_logits(base, adapter, ids, dtype=torch.float32):
    """Logits [B, T, V] of PEFT's model of ``adapter`` on ``base`` (float64: no float32 step,
    tests/helpers/float64.py)."""
    def run():
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="eager")
        with torch.no_grad():
            return peft.PeftModel.from_pretrained(model, adapter).eval()(ids).logits.numpy()

    if dtype == torch.float32:
        return run()
    with TorchFloat64():
        return run()


@pytest.fixture(scope="module", params=["gemma4_e2b_vllm", "gemma4_e4b"])
def run(request, hf_checkpoint, tmp_path_factory):
    """One miniature trained three ways from one adapter: TRL in float32 and in float64, and `gemport sft --merge`
    in a fresh process on one CPU device (the recipe's fields as a `trl sft --config` YAML)."""
    _, checkpoint = hf_checkpoint(request.param)
    root = tmp_path_factory.mktemp(request.param)
    base = root / "base"
    shutil.copytree(checkpoint, base)
    tokenizer().save_pretrained(base)
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats()))
    data = datasets.Dataset.from_list(chats())

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():  # an adapter as if trained on GPUs: B away from PEFT's zero init
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(root / "adapter0")
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(root / "trl"), **CONFIG), train_dataset=data,
                         processing_class=tokenizer())
    trainer.train()
    trainer.model.save_pretrained(root / "trl32")

    out = root / "out"
    fields = {k: v for k, v in CONFIG.items() if k not in ("use_cpu", "save_strategy")}
    (root / "sft.yaml").write_text(yaml.safe_dump({"model_name_or_path": str(base), "dataset_name": str(root / "data.jsonl"),
                                                   "output_dir": str(out), "save_strategy": "no", **fields}))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    done = subprocess.run([sys.executable, "-m", "gemport", "sft", "--config", str(root / "sft.yaml"),
                           "--init-adapter", str(root / "adapter0"), "--merge"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(root=root, base=base, out=out, logs=[e for e in trainer.state.log_history if "loss" in e],
                exact=float64_logs(base, root, data, save_to=root / "trl64"))


def test_gemport_sft_trains_as_trl_under_the_float64_floor(run):
    """Loss and grad_norm of every logged step within 10x the float32 TRL run's distance from the float64 run.

    On these KV-shared miniatures the float32 TRL run's grad_norm is 0.1-1% from the float64 run's once Adam has
    moved the adapter (steps 2 and 3), past what float64.trajectory_bound accepts as float32 noise; there the
    gradient norms are judged on steps 0 and 1 (both at the starting adapter: warmup's first rate is 0), the
    losses on every step."""
    state = json.loads((run["out"] / "trainer_state.json").read_text())
    ours = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in ours] == [e["step"] for e in run["logs"]] == [1, 2, 3, 4]
    for quantity, steps in (("loss", slice(None)), ("grad_norm", slice(0, 2))):
        bound = trajectory_bound([run["logs"]], run["exact"], quantity, steps)
        errors = [relative(got[quantity], want[quantity]) for got, want in list(zip(ours, run["exact"]))[steps]]
        assert max(errors) <= bound, (quantity, errors, bound)


def test_the_adapter_and_the_merged_checkpoint_read_back_as_the_trained_model(run):
    """PEFT loads output_dir's adapter: in float64, its logits are as near the float64 TRL run's adapter's as 10x
    the float32 TRL run's adapter's are. transformers loads merged/ and gives that adapter's model within 10x
    PEFT's own float32 distance from float64 (merging adds B A to W in float32: nothing more)."""
    root, base, out = run["root"], run["base"], run["out"]
    t = tokenizer()
    ids = torch.tensor(t(t.apply_chat_template(chats(1)[0]["messages"], tokenize=False))["input_ids"])[None]
    exact = peft_logits(base, out, ids, dtype=torch.float64)
    trl64 = peft_logits(base, root / "trl64", ids, dtype=torch.float64)
    floor = np.abs(peft_logits(base, root / "trl32", ids, dtype=torch.float64) - trl64).max()
    moved = np.abs(peft_logits(base, root / "adapter0", ids, dtype=torch.float64) - trl64).max()
    error = np.abs(exact - trl64).max()
    print(f"adapter: error {error:.2e}, floor {floor:.2e}, moved {moved:.2e}")
    assert 0 < floor and error <= 10 * floor, (error, floor, moved)

    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32,
                                                               attn_implementation="eager")
    with torch.no_grad():
        got = merged.eval()(ids).logits.numpy()
    floor = np.abs(peft_logits(base, out, ids) - exact).max()
    assert 0 < floor < 1e-4 and np.abs(got - exact).max() <= 10 * floor, (np.abs(got - exact).max(), floor)
    # merged/ is a whole checkpoint: per-layer inputs and all, loadable without its base.
    assert json.loads((out / "merged" / "config.json").read_text())["hidden_size_per_layer_input"] == 8


# 6 layers x 7 projections, less k_proj and v_proj of E2B's and E4B's 2 KV-shared layers (they reuse earlier K and
# V); on the 26B-A4B, less v_proj of its global layer (k_eq_v), plus each layer's two expert weights (PEFT's
# target_parameters: experts.base_layer is gate_up_proj, experts is down_proj).
MINIATURES = {
    "gemma4-e2b": ({}, 6 * 7 - 2 * 2),
    "gemma4-e4b": ({}, 6 * 7 - 2 * 2),
    "gemma4-26b-a4b": ({"lora_target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}, 6 * 7 - 1 + 6 * 2),
}


@pytest.mark.parametrize("preset", MINIATURES)
def test_gemport_parity_agrees_on_a_miniature(tmp_path, monkeypatch, preset):
    """`gemport parity --miniature` of a preset's config.json (real sizes, no weights): gemma4-e2b's miniature keeps
    per-layer inputs, KV-shared layers and double-wide MLPs, gemma4-e4b's per-layer inputs and KV-shared layers with 2 KV
    heads and MLPs of one width; gemma4-26b-a4b's keeps the mixture of experts (routed
    as transformers routes, LoRA on the experts as PEFT's target_parameters). TRL + PEFT and the port agree step by
    step under parity's own tolerances, on every adapted module."""
    extra, adapters = MINIATURES[preset]
    from gemport.specs import GemmaSpec
    from gemport_cli import gemport
    from sft_recipe import RECIPE

    real = tmp_path / preset
    real.mkdir()
    (real / "config.json").write_text(json.dumps(GemmaSpec.preset(preset).to_hf_config()))
    tokenizer().save_pretrained(real)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats()))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**RECIPE, "model_name_or_path": "unused", "use_peft": True,
                                                          **extra}))
    monkeypatch.chdir(tmp_path)
    done = gemport("parity", real, tmp_path / "data.jsonl", "--config", tmp_path / "recipe.yaml", "--miniature",
                   "--vocab-size", 128, ok=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gemport-parity" / "parity.json").read_text())
    assert report["ok"] and [r["step"] for r in report["steps"]] == [0, 1, 2, 3]
    assert len(report["adapters"]) == adapters
