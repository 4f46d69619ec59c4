"""`gemport dpo --config dpo.yaml`: a `trl dpo` recipe run unchanged, equal to TRL's DPOTrainer + PEFT step for step.

A tiny Gemma 3 with its tokenizer (Gemma's chat template) and conversational preference records. The recipe of
TRL's documentation (use_peft, lora_r, the rest at TRL's defaults: lora_dropout 0.05, bf16) trains and leaves
what TRL leaves: trainer_state.json with DPO's metrics, the adapter, merged/. From a PEFT adapter
(``--init-adapter``, TRL given a PeftModel: a frozen copy of it is the reference) the run is SIGKILLed after step 2,
resumed, and its every logged step and final adapter equal TRL's own training, within 10x the distance of TRL in
float32 from TRL in float64 (``dpo_tolerance.tolerance``, tests/helpers/).
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from gemport.errors import RecipeError
from gemport import recipe
from gemport_cli import gemport, one_line_error
from dpo_tolerance import EPS32, reward_operands, tolerance
from repo_paths import HELPERS, ROOT
from dpo_command import write_recipe

CHILD = HELPERS / "sft_child.py"
# Three pairs, one a micro-batch, two a step: step 2 is the epoch's short step (one micro-batch), step 3 the next
# epoch's first. Evaluated at steps 2 and 3 (the last) on three held-out pairs, two an eval batch: the last batch is
# short.
RECIPE = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-2,
              max_grad_norm=0.05, beta=0.5, logging_steps=1, save_steps=2, seed=3, bf16=False,
              eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
METRICS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected")


def one_device(tmp_path):
    """A subprocess's environment: JAX on one CPU device, compiled executables cached in ``tmp_path``."""
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def peft_logits(base, adapter, ids, dtype="float64", merge=False):
    """transformers' logits float64 [B, T, V] of ``base`` with the PEFT ``adapter`` (None: without), in ``dtype``;
    ``merge``: PEFT's ``merge_and_unload`` first."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype),
                                                              attn_implementation="eager")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
        model = model.merge_and_unload() if merge else model
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.double().numpy()


def test_a_trl_documentation_recipe_runs_unchanged(dpo_workdir, tmp_path):
    """TRL's documented recipe shape: use_peft with lora_r and lora_alpha, everything else TRL's default (lora_dropout
    0.05, which TRL's disable_dropout turns off; bf16; gradient_checkpointing). trainer_state.json has TRL's DPO
    metric names at every step; PEFT loads the adapter, which moved away from the base, and merged/ gives the same
    logits as the base with it, within 10x the distance of PEFT's own float32 merge from the float64 adapter."""
    out = tmp_path / "out"
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, output_dir=str(out), use_peft=True, lora_r=8,
                          lora_alpha=16, lora_target_modules="all-linear", max_steps=2, logging_steps=1,
                          per_device_train_batch_size=2, learning_rate=1e-3)
    # One device (a subprocess): the step compiles faster than on the suite's eight simulated ones.
    result = subprocess.run([sys.executable, "-m", "gemport", "dpo", "--config", str(config), "--merge"],
                            env=one_device(tmp_path), cwd=CHILD.parent, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reference: the base, LoRA off" in result.stdout
    state = json.loads((out / "trainer_state.json").read_text())
    logged = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in logged] == [1, 2]
    for entry in logged:
        assert set(METRICS) <= set(entry) and all(np.isfinite(entry[k]) for k in METRICS), entry
    assert logged[0]["rewards/margins"] == 0.0  # step 1: the fresh adapter's B is zero, policy = reference
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["lora_dropout"] == 0.05 and adapter["r"] == 8
    ids = np.array([[2, 5, 9, 14, 3, 7, 11, 4]])
    base, tuned = peft_logits(dpo_workdir / "base", None, ids), peft_logits(dpo_workdir / "base", out, ids)
    assert np.abs(tuned - base).max() > 0
    merged = peft_logits(out / "merged", None, ids)
    floor = np.abs(peft_logits(dpo_workdir / "base", out, ids, "float32", merge=True) - tuned).max()
    bound = 10 * max(floor, EPS32 * np.abs(tuned).max())
    assert np.abs(merged - tuned).max() <= bound, (np.abs(merged - tuned).max(), bound)


@pytest.mark.parametrize("fields, words", [
    ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True"),
    ({"loss_type": ["aot"]}, "loss_type=['aot']"),
    ({"rpo_alpha": 1.0}, "rpo_alpha: not a field of trl dpo"),
    ({"router_aux_loss_coef": 0.01}, "router_aux_loss_coef=0.01: gemport dpo does not reproduce"),
    ({"eval_strategy": "steps", "dataset_test_split": "validation"}, "validation"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type='fp4'"),
])
def test_fields_gemport_does_not_reproduce_are_refused_by_name(dpo_workdir, tmp_path, fields, words):
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, output_dir=str(tmp_path / "out"), use_peft=True, **fields)
    one_line_error(gemport("dpo", "--config", config, ok=False), words)


def test_help_speaks_trl():
    shown = gemport("dpo", "--help").stdout
    assert "usage: gemport dpo" in shown and "trl dpo --config" in shown and "rewards/margins" in shown


def test_mapped_fields_are_said():
    notes = recipe.read({"padding_free": True, "ref_model_sync_steps": 64}, command="dpo").notes
    assert any(n.startswith("padding_free=True") for n in notes) and any("sync_ref_model" in n for n in notes)
    with pytest.raises(RecipeError, match="completion_only_loss: not a field of trl dpo"):
        recipe.read({"completion_only_loss": True}, command="dpo")


def trl_run(root, out, dtype):
    """TRL's DPOTrainer on a PeftModel of adapter0 (its frozen "ref" copy the reference), the recipe's DPOConfig
    fields, on torch's CPU, evaluating on the test split; returns its log history (train and eval entries) and
    trained model."""
    import datasets
    import peft
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    # gradient_checkpointing off: torch recomputes outside TorchFloat64 (float32); the math is the same.
    args = DPOConfig(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no",
                     gradient_checkpointing=False, **{k: v for k, v in RECIPE.items() if k != "save_steps"})
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=dtype, attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(model, root / "adapter0", is_trainable=True)
    data = datasets.load_dataset(str(root / "data"))
    trainer = DPOTrainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["test"],
                         processing_class=transformers.AutoTokenizer.from_pretrained(root / "base"))
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e or "eval_loss" in e], model


def lora_factors(model):
    return {n.replace(".default", ""): p.detach().double().numpy() for n, p in model.named_parameters()
            if ".default." in n}


def test_gemport_dpo_equals_trl_through_a_sigkill_and_resumes(dpo_workdir, tmp_path):
    """`gemport dpo --init-adapter` SIGKILLed once step 3 is logged (checkpoint 2 complete, no 3), run again: it
    resumes from step 2 and its step 3 is the killed run's exactly; every logged step (loss, grad_norm,
    learning_rate, rewards, logps), the evaluations at step 2 and after the last step on the test split
    (eval_loss, eval_rewards/*, eval_logps/*; its last batch short) and the final adapter equal TRL's
    uninterrupted training from the same adapter; the adapter left in output_dir gives TRL's logits in PEFT.
    Step 2 is an epoch's short step (one micro-batch of two), whose mean TRL takes over the one."""
    import float64
    import torch
    from safetensors.numpy import load_file

    out = tmp_path / "out"
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, output_dir=str(out), **RECIPE)
    env = one_device(tmp_path)  # the restart loads the first process's executables instead of compiling again
    command = [sys.executable, str(CHILD), "kill:3", "dpo", "--config", str(config), "--init-adapter",
               str(dpo_workdir / "adapter0")]
    killed = subprocess.run(command, env=env, cwd=CHILD.parent, capture_output=True, text=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (out / "adapter_config.json").exists()
    assert max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == 2
    before = json.loads((out / "trainer_state.json").read_text())["log_history"]
    resumed = subprocess.run(command[:2] + ["kill:99"] + command[3:], env=env, cwd=CHILD.parent,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "reference: the starting adapter" in resumed.stdout
    assert "| 2/3 [" in resumed.stderr and "| 0/3 [" not in resumed.stderr  # the bar starts at the checkpoint's step
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"]
              if "loss" in e or "eval_loss" in e]
    # Evaluated every eval_steps and, as HF does, after the last step.
    assert [(e["step"], "eval_loss" in e) for e in logged] == [(1, False), (2, False), (2, True), (3, False), (3, True)]
    # Step 3 trained again from checkpoint 2: the same, exactly; step 2's evaluation kept, not run again.
    kept = [e for e in before if "loss" in e or "eval_loss" in e]
    assert len(kept) >= 4 and kept == logged[:len(kept)]

    logs32, model32 = trl_run(dpo_workdir, tmp_path / "trl32", torch.float32)
    with float64.TorchFloat64():
        logs64, model64 = trl_run(dpo_workdir, tmp_path / "trl64", torch.float64)
    assert logs64[0]["rewards/margins"] == 0.0 != logs64[3]["rewards/margins"]  # the reference: adapter0
    for got, want32, want64 in zip(logged, logs32, logs64, strict=True):
        assert got["step"] == want64["step"] and got["epoch"] == pytest.approx(want64["epoch"])
        # An evaluation logs eval_loss and TRL's DPO metrics as eval_*: each batch's mean, averaged over batches.
        prefix = "eval_" if "eval_loss" in want64 else ""
        names = [prefix + k for k in METRICS if not (prefix and k in ("grad_norm", "learning_rate"))]
        assert set(names) <= set(got), (sorted(got), names)
        for k in names:
            if k.endswith("rewards/accuracies") or want64[k] == 0.0:
                assert got[k] == want64[k] == want32[k], (got["step"], k)
                continue
            bare = k.removeprefix(prefix)
            logps = {m: want64[prefix + m] for m in ("logps/chosen", "logps/rejected")}
            operands = reward_operands(RECIPE["beta"], logps) if bare == "loss" or bare.startswith("rewards/") else 0.0
            error = abs(got[k] - want64[k]) / abs(want64[k])
            assert error <= tolerance(want32[k], want64[k], operands), (got["step"], k, got[k], want32[k], want64[k])
    assert min(e["grad_norm"] for e in logs64 if "grad_norm" in e) > RECIPE["max_grad_norm"]  # clipping is in play

    trained = {k.replace(".weight", ""): v for k, v in load_file(out / "adapter_model.safetensors").items()}
    want32 = lora_factors(model32)
    want64 = lora_factors(model64)
    assert sorted(trained) == sorted(k.replace(".weight", "") for k in want64)
    floor = max(np.linalg.norm(want32[k] - v) / np.linalg.norm(v) for k, v in want64.items())
    for k, v in want64.items():
        error = np.linalg.norm(trained[k.replace(".weight", "")] - v) / np.linalg.norm(v)
        assert error <= 10 * max(floor, EPS32), (k, error, floor)
    ids = np.array([[2, 5, 9, 14, 3, 7, 11, 4]])
    with torch.no_grad():
        exact = model64(torch.as_tensor(ids)).logits.double().numpy()
        rounded = model32(torch.as_tensor(ids)).logits.double().numpy()
    got = peft_logits(dpo_workdir / "base", out, ids)
    bound = 10 * max(np.abs(rounded - exact).max(), EPS32 * np.abs(exact).max())
    assert np.abs(got - exact).max() <= bound, (np.abs(got - exact).max(), bound)


# A recipe in TRL's documentation style for `gemport parity --trainer dpo`: use_peft with lora_r, lora_alpha and
# all-linear; lora_dropout (0.05), bf16 and gradient_checkpointing at TRL's defaults; two micro-batches a step and
# clipping in play (a fresh adapter's first gradients exceed 0.05), across an epoch's short step. It evaluates, which
# parity leaves out on both sides (it compares the training steps).
PARITY = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules="all-linear", per_device_train_batch_size=1,
              gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3, max_grad_norm=0.05, beta=0.5, seed=3,
              eval_strategy="steps", eval_steps=2)


def test_gemport_parity_takes_a_dpo_recipe(dpo_workdir, tmp_path, monkeypatch):
    """`gemport parity --trainer dpo`: TRL's DPOTrainer + PEFT and gemport dpo's step from the same adapter agree at
    every step on loss, grad_norm and TRL's DPO metrics, and on the final adapter, each within 10x its floor
    measured in the run (TRL float64 vs float32); parity.json holds the metrics with their bounds."""
    monkeypatch.chdir(tmp_path)
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, **PARITY)
    done = gemport("parity", dpo_workdir / "base", dpo_workdir / "data" / "train.jsonl", "--config", config,
                   "--trainer", "dpo", ok=False)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("lora_dropout=0.05: TRL's disable_dropout")
    assert lines[-1].startswith("agree within loss 10 x the floor (at most ")
    assert "DPO metrics 10 x the floor" in lines[-1] and "rewards/accuracies equal" in lines[-1]
    report = json.loads((tmp_path / "gemport-parity" / "parity.json").read_text())
    assert report["ok"] and [r["step"] for r in report["steps"]] == [0, 1, 2]
    assert report["floor_name"] == "TRL float64 vs float32"
    assert {m["name"] for m in report["metrics"]} == set(METRICS[3:]) and len(report["metrics"]) == 3 * 6
    assert all(m["bound"] == pytest.approx(10 * m["floor"]) for m in report["metrics"]
               if m["name"] != "rewards/accuracies")
    assert min(r["grad_norm_gpu"] for r in report["steps"]) > PARITY["max_grad_norm"]  # clipping is in play
    assert any(m["gpu"] != 0 for m in report["metrics"] if m["name"] == "rewards/margins")  # the adapter moved


def test_gemport_parity_fails_a_dpo_port_with_another_beta(dpo_workdir, tmp_path, monkeypatch):
    """The port trained with beta 0.1 where the recipe says 0.5: at step 0 (policy = reference, loss log 2 on both
    sides) the gradient is beta times another: exit 1 naming step 0's grad_norm."""
    monkeypatch.chdir(tmp_path)
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, **PARITY)
    port = write_recipe(tmp_path / "port.yaml", dpo_workdir, **dict(PARITY, beta=0.1))
    done = gemport("parity", dpo_workdir / "base", dpo_workdir / "data" / "train.jsonl", "--config", config,
                   "--trainer", "dpo", "--port-config", port, "--steps", 1, "--rtol", 1e-4, "--adapter-rtol", 1e-2,
                   ok=False)
    print(done.stdout)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DISAGREE at step 0: grad_norm" in done.stdout.splitlines()[-1]
    assert not json.loads((tmp_path / "gemport-parity" / "parity.json").read_text())["ok"]


def test_gemport_parity_compares_a_dpo_recipe_in_bfloat16(dpo_workdir, tmp_path, monkeypatch):
    """`--dtype bfloat16`: the recipe as bf16 trains it (TRL on a bfloat16 base under CPU autocast, the port on a
    bfloat16 base, float32 adapters on both) against TRL's own float32-vs-bfloat16 floor, and the same port with
    another beta fails it at step 0 (the gradient is beta times another)."""
    monkeypatch.chdir(tmp_path)
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, **PARITY)
    port = write_recipe(tmp_path / "port.yaml", dpo_workdir, **dict(PARITY, beta=0.1))
    args = ("parity", dpo_workdir / "base", dpo_workdir / "data" / "train.jsonl", "--config", config, "--trainer",
            "dpo", "--dtype", "bfloat16")
    done = gemport(*args, ok=False)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gemport-parity" / "parity.json").read_text())
    assert report["ok"] and report["floor_name"] == "TRL float32 vs bfloat16 (autocast)"
    broken = gemport(*args, "--port-config", port, "--steps", 1, ok=False)
    assert broken.returncode == 1, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert "DISAGREE at step 0: grad_norm" in broken.stdout.splitlines()[-1], broken.stdout[-2000:]


def test_the_dpo_verdict_names_a_metric_beyond_its_floor():
    """Each DPO metric is held to 10x its step's floor; rewards/accuracies (a share of pairs) to TRL's own two runs'
    absolute difference: equal when they agree."""
    from gemport.check.dpo_parity import FLOORS, DPOTrajectory, MetricRow
    from gemport.check.parity import LEAST_FLOOR, StepRow

    rows = (StepRow(0, 1e-3, 1e-3, 0.69, 0.69, 2.0, 2.0, LEAST_FLOOR, LEAST_FLOOR),)
    metrics = (MetricRow(0, "rewards/margins", 0.5, 0.5 * (1 + 1e-4), 1e-6),
               MetricRow(0, "rewards/accuracies", 1.0, 0.5, 0.0))
    report = DPOTrajectory(rows, FLOORS, metrics=metrics)
    assert [d[1] for d in report.disagreements()] == ["rewards/margins", "rewards/accuracies"]
    assert report.first_disagreement() == (
        "step 0: rewards/margins 0.50005 (port) vs 0.5 (GPU recipe), relative 1.00e-04 = 100 x the floor 1e-06 > 1e-05")
    assert DPOTrajectory(rows, FLOORS, metrics=metrics[1:]).first_disagreement() == (
        "step 0: rewards/accuracies 0.5 (port) vs 1 (GPU recipe), absolute 5.00e-01 > 0")
    assert report.table().splitlines()[-1].startswith("DISAGREE at step 0: rewards/margins")
    within = DPOTrajectory(rows, FLOORS, metrics=(metrics[0]._replace(port=0.5 * (1 + 5e-6)),
                                                  metrics[1]._replace(floor=0.5)))
    assert within.ok and "rewards/accuracies equal (or within TRL's own two runs)" in within.table()


@pytest.mark.parametrize("fields, args, words", [
    ({}, ("--loss", "tunix"), "--loss tunix: gemport dpo trains with the segment step only"),
    ({"precompute_ref_log_probs": True}, (), "precompute_ref_log_probs=True"),
    ({"use_peft": False}, (), "use_peft is not set"),
    ({}, ("--sft-data",), "no ['chosen', 'rejected'] key"),
    ({}, ("--other-template",), "records[0]: conversation 0: gemport's Gemma3"),
    ({}, ("--port-config", "port.yaml"), "port.yaml: its lora_* fields differ"),
])
def test_dpo_parity_refuses_before_either_side_trains(dpo_workdir, tmp_path, monkeypatch, fields, args, words):
    """Recipe fields, the comparison's options, the data's format and the tokenizer's template are checked before
    TRL or the port trains (here, training at all fails the test), with a one-line typed error."""
    import shutil

    import trl

    from gemport.run.sft import SFTRun

    monkeypatch.setattr(trl.DPOTrainer, "train", lambda self: pytest.fail("the GPU side trained"))
    monkeypatch.setattr(SFTRun, "train", lambda self: pytest.fail("the port trained"))
    monkeypatch.chdir(tmp_path)
    base, data = dpo_workdir / "base", dpo_workdir / "data" / "train.jsonl"
    if "--sft-data" in args:
        data = tmp_path / "sft.jsonl"
        data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    if "--other-template" in args:  # Gemma 3's turns and something more: TRL would train on other tokens
        import transformers

        base = tmp_path / "base"
        shutil.copytree(dpo_workdir / "base", base)
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template += "{{ '\n' }}"
        tokenizer.save_pretrained(base)
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, **{**PARITY, **fields})
    write_recipe(tmp_path / "port.yaml", dpo_workdir, **{**PARITY, "lora_r": 8})
    options = [a for a in args if a not in ("--sft-data", "--other-template")]
    one_line_error(gemport("parity", base, data, "--config", config, "--trainer", "dpo", *options, ok=False), words)
