"""`gemport sft --config sft.yaml`: a `trl sft` recipe run unchanged, equal to TRL's SFTTrainer + PEFT step for step.

The end-to-end test trains a tiny Gemma 4 for 4 steps from one PEFT adapter (random A and B) with TRL on torch
and with `gemport sft --init-adapter` on JAX. The gemport run gets SIGTERM once step 1 is logged: it saves the
checkpoint of step 2 and exits with 143 (a spot VM's preemption). Run again, it resumes from step 2 and is
SIGKILLed after step 3; run a third time, it resumes from step 2 again, and its step 3 is the second run's
exactly. Both in float32 on CPU: loss, grad_norm and learning rate of every step, and the eval loss, agree
within 1e-4 relative; the adapter left in output_dir loads in PEFT and gives TRL's model's logits.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from gemport.errors import RecipeError
from gemport import recipe
from gemport_cli import gemport, one_line_error
from chats import chats, tokenizer
from repo_paths import HELPERS
from sft_command import RECIPE, write_recipe

CHILD = HELPERS / "sft_child.py"


def trl_run(root, out):
    """TRL's SFTTrainer on a PeftModel of adapter0, the recipe's SFTConfig fields, on torch's CPU in float32."""
    import datasets
    import peft
    import torch
    import transformers
    from trl import SFTConfig, SFTTrainer

    fields = {k: v for k, v in RECIPE.items() if k != "dataloader_num_workers"}
    args = SFTConfig(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no", **fields)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32,
                                                              attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(model, root / "adapter0", is_trainable=True)
    splits = datasets.load_dataset(str(root / "data"))
    trainer = SFTTrainer(model=model, args=args, train_dataset=splits["train"], eval_dataset=splits["test"],
                         processing_class=transformers.AutoTokenizer.from_pretrained(root / "base"))
    trainer.train()
    return trainer.state.log_history, model


def relative(a, b):
    return abs(a - b) / max(abs(a), 1e-12)


def test_gemport_sft_equals_trl_through_a_sigterm_a_sigkill_and_resumes(sft_workdir, tmp_path):
    import peft
    import torch
    import transformers

    out = tmp_path / "out"
    config = write_recipe(tmp_path / "sft.yaml", sft_workdir, output_dir=str(out), save_steps=2, save_total_limit=1,
                          report_to="tensorboard")
    args = ["--config", config, "--init-adapter", sft_workdir / "adapter0"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               # The rerun loads the first process's executables instead of compiling again.
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def child(how):
        return subprocess.run([sys.executable, str(CHILD), how, *map(str, args)], env=env, cwd=CHILD.parent,
                              capture_output=True, text=True, timeout=300)

    def steps_saved():
        return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())

    termed = child("term:1")  # the hooks of step 1 run while step 2 trains: the next boundary is step 2
    assert termed.returncode == 143, termed.stderr[-3000:]
    assert "gemport sft: SIGTERM received: saved the checkpoint of step 2 in" in termed.stderr
    assert "Traceback" not in termed.stderr and steps_saved() == ["2"]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and not (out / "adapter_config.json").exists()
    killed = child("kill:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before_kill = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in before_kill if "loss" in e] == [1, 2, 3] and steps_saved() == ["2"]
    resumed = subprocess.run([sys.executable, "-m", "gemport", "sft", *map(str, args)], env=env, cwd=CHILD.parent,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dataloader_num_workers=2: " in resumed.stdout  # a mapped field is said

    state = json.loads((out / "trainer_state.json").read_text())
    assert state["log_history"][:len(before_kill)] == before_kill  # step 3 again from checkpoint 2: the same
    expected, trl_model = trl_run(sft_workdir, tmp_path / "trl")
    train = [e for e in state["log_history"] if "loss" in e]
    trl_train = [e for e in expected if "loss" in e and "grad_norm" in e]
    assert state["global_step"] == 4 and [e["step"] for e in train] == [1, 2, 3, 4]
    for ours, theirs in zip(train, trl_train, strict=True):
        assert ours["step"] == theirs["step"] and ours["epoch"] == pytest.approx(theirs["epoch"])
        assert relative(theirs["loss"], ours["loss"]) < 1e-4, (ours, theirs)
        assert relative(theirs["grad_norm"], ours["grad_norm"]) < 1e-4, (ours, theirs)
        assert relative(theirs["learning_rate"], ours["learning_rate"]) < 1e-6 or theirs["learning_rate"] == 0
    evals = [e for e in state["log_history"] if "eval_loss" in e]
    trl_evals = [e for e in expected if "eval_loss" in e]
    assert [e["step"] for e in evals] == [e["step"] for e in trl_evals] == [3, 4]  # and after the last step, as HF
    for ours, theirs in zip(evals, trl_evals):
        assert relative(theirs["eval_loss"], ours["eval_loss"]) < 1e-4, (ours, theirs)

    assert steps_saved() == ["4"] and (out / "checkpoints" / "gemport_lora.json").is_file()  # save_total_limit 1
    assert list((out / "runs").glob("events.out.tfevents.*"))

    def logits(adapter):
        base = transformers.AutoModelForCausalLM.from_pretrained(sft_workdir / "base", dtype=torch.float32,
                                                                 attn_implementation="eager")
        with torch.no_grad():
            return peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits.numpy()

    t = tokenizer()
    ids = torch.tensor(t(t.apply_chat_template(chats(1)[0]["messages"], tokenize=False))["input_ids"])[None]
    with torch.no_grad():
        want = trl_model.eval()(ids).logits.numpy()
    moved = np.abs(want - logits(sft_workdir / "adapter0")).max()  # how far the 4 steps moved the logits
    assert np.abs(logits(out) - want).max() < 1e-2 * moved


def test_help_speaks_trl():
    done = gemport("sft", "--help")
    for words in ("trl sft --config", "--key value", "trainer_state.json", "resume_from_checkpoint", "--init-adapter",
                  "--merge", "save_total_limit", "bf16", "SIGTERM", "143", "--coordinator-address", "--num-processes",
                  "--process-id", "--distributed", "load_in_4bit"):
        assert words in done.stdout, words


@pytest.mark.parametrize("fields, error, words", [
    ({"fsdp": "full_shard"}, RecipeError, "fsdp='full_shard': gemport sft does not reproduce"),
    ({"learning_rat": 1e-4}, RecipeError, "learning_rat: not a field"),
    ({"fp16": True}, RecipeError, "fp16=True: TPUs compute in bfloat16"),
    ({"lora_task_type": "SEQ_CLS"}, RecipeError, "lora_task_type"),
])
def test_fields_gemport_does_not_reproduce_are_refused_by_name(fields, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        recipe.read({**RECIPE, **fields})


def test_overrides_read_as_trl_sft_reads_them():
    got = recipe.parse_overrides(["--learning_rate", "1e-4", "--packing", "--lora_target_modules", "q_proj", "v_proj",
                                  "--max_steps=7", "--output_dir", "out"])
    assert got == {"learning_rate": 1e-4, "packing": True, "lora_target_modules": ["q_proj", "v_proj"],
                   "max_steps": 7, "output_dir": "out"}
    r = recipe.read({**RECIPE, "gradient_checkpointing": False, "use_peft": True, "lora_r": 8}, got)
    assert r.sft["learning_rate"] == 1e-4 and r.sft["max_steps"] == 7 and r.sft["logging_steps"] == 1
    assert r.sft["num_train_epochs"] == 3.0  # TRL's default for what the recipe leaves out
    assert r.lora() == {"peft_type": "LORA", "r": 8, "lora_alpha": 32, "lora_dropout": 0.05,
                        "target_modules": ["q_proj", "v_proj"], "use_rslora": False}
    assert [n.split(":")[0] for n in r.notes] == ["dataloader_num_workers=2"]
    assert r.sft["gradient_checkpointing"] is False  # used (the run's remat), not a note


def test_cli_errors_name_what_is_missing(sft_workdir, tmp_path):
    config = write_recipe(tmp_path / "sft.yaml", sft_workdir, output_dir=str(tmp_path / "out"))
    one_line_error(gemport("sft", "--config", config, ok=False), "use_peft is not set")
    one_line_error(gemport("sft", "--config", config, "--use_peft", "--lora_target_modules", "q_proj",
                           "--dataset_test_split", "validation", ok=False), "no split 'validation'")
    one_line_error(gemport("sft", "--config", config, "--use_peft", "--resume_from_checkpoint", "true", ok=False),
                   "no checkpoint in")
    one_line_error(gemport("sft", "--config", config, "--bogus", "1", ok=False), "bogus: not a field")
    other = gemport("plan", "gemma4-31b", "--devices", "4", "--learning_rate", "1", ok=False)
    assert other.returncode == 2 and "unrecognized arguments: --learning_rate 1" in other.stderr


def test_a_recipe_leaving_lora_dropout_at_trls_default_trains(sft_workdir, tmp_path):
    """TRL's ModelConfig gives lora_dropout 0.05 to a recipe that does not set it (PEFT's LoraConfig: 0.0);
    `gemport sft` trains with it (it used to stop at the first step: Qwix found no rngs) and records it."""
    out = tmp_path / "out"
    config = write_recipe(tmp_path / "sft.yaml", sft_workdir, output_dir=str(out), use_peft=True, lora_r=8,
                          lora_target_modules=["k_proj", "v_proj", "down_proj"], max_steps=1, eval_strategy="no",
                          save_strategy="no", max_length=64)
    assert "lora_dropout" not in yaml.safe_load(config.read_text())
    gemport("sft", "--config", config)
    state = json.loads((out / "trainer_state.json").read_text())
    (logged,) = [e for e in state["log_history"] if "loss" in e]
    assert logged["step"] == 1 and np.isfinite(logged["loss"]) and np.isfinite(logged["grad_norm"])
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == 0.05


def test_a_rerun_loads_the_step_its_first_run_compiled_and_trains_the_same(sft_workdir, tmp_path, caplog):
    """`gemport sft` keeps its compiled programs (``--compile-cache``): a second run of the recipe (as a resume
    after a preemption is) loads its train step from the cache instead of compiling it, says so, and trains the
    same adapter, bit for bit."""
    import logging

    import jax
    from safetensors.numpy import load_file

    cache = tmp_path / "xla"
    config = write_recipe(tmp_path / "sft.yaml", sft_workdir, use_peft=True, lora_r=4,
                          lora_target_modules=["q_proj", "down_proj"], max_steps=2, eval_strategy="no",
                          save_strategy="no", max_length=64)
    kept, before = jax.config.jax_persistent_cache_min_compile_time_secs, jax.config.jax_compilation_cache_dir
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # a tiny step may compile in under 1 s
    try:
        first = gemport("sft", "--config", config, "--output_dir", tmp_path / "a", "--compile-cache", cache)
        with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
            second = gemport("sft", "--config", config, "--output_dir", tmp_path / "b", "--compile-cache", cache)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", kept)
    assert jax.config.jax_compilation_cache_dir == before  # the command gives JAX's cache back as it was
    assert f"compile cache {cache}: nothing loaded" in first.stdout, first.stdout
    (said,) = [line for line in second.stdout.splitlines() if line.startswith(f"compile cache {cache}: ")]
    assert int(said.split(": ")[1].split()[0]) >= 1, said
    assert any("cache hit for 'jit_train_step'" in r.getMessage() for r in caplog.records), caplog.text
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in "ab")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_dry_run_refuses_a_compile_cache(sft_workdir, tmp_path):
    config = write_recipe(tmp_path / "sft.yaml", sft_workdir, use_peft=True, lora_target_modules=["q_proj"])
    one_line_error(gemport("sft", "--config", config, "--dry-run", "--compile-cache", tmp_path / "xla", ok=False),
                   "--compile-cache", "a dry run compiles without the cache")
