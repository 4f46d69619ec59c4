"""gemport.check.parity.trajectory and `gemport parity`: TRL SFTTrainer + PEFT against the port, step by step."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from gemport.errors import LoraError, MaskError, OptimizerConfigError, RecipeError
from gemport.check.parity import (LEAST_FLOOR, Tolerances, Trajectory, StepRow, dropout_note, read_recipe, trajectory,
                            without_dropout)
from gemport_cli import gemport
from pictures import assert_picture
from chats import chats, tokenizer
from sft_recipe import RECIPE


@pytest.fixture(scope="module")
def recipe(hf_checkpoint, tmp_path_factory):
    """A tiny Gemma 4 with a tokenizer, a data sample and the recipe as `trl sft --config` files."""
    _, base = hf_checkpoint("gemma4_mesh")
    root = tmp_path_factory.mktemp("parity")
    shutil.copytree(base, root / "base")
    tokenizer().save_pretrained(root / "base")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats()))
    # As most recipes in the wild: lora_dropout left at TRL's default (0.05), which parity compares at 0 and says so.
    trl_default = {k: v for k, v in RECIPE.items() if k != "lora_dropout"}
    (root / "recipe.yaml").write_text(yaml.safe_dump({**trl_default, "model_name_or_path": "unused", "use_peft": True}))
    (root / "broken.yaml").write_text(yaml.safe_dump({**RECIPE, "assistant_only_loss": False}))
    return root


def run_cli(*args):
    return gemport("parity", *args, ok=False)


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """`gemport parity` writes gemport-parity/ (parity.json, parity.png) into the working directory."""
    monkeypatch.chdir(tmp_path)


def test_cli_broken_port_exits_1_naming_step_0_and_the_loss(recipe):
    done = run_cli(recipe / "base", recipe / "data.jsonl", "--config", recipe / "recipe.yaml",
                   "--port-config", recipe / "broken.yaml")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "DISAGREE at step 0: loss" in done.stdout.splitlines()[-1]
    report = json.loads(Path("gemport-parity/parity.json").read_text())
    assert not report["ok"] and report["first_disagreement"].startswith("step 0: loss")
    assert done.stdout.startswith("lora_dropout=0.05: compared with lora_dropout=0 on both sides")


def test_a_recipe_with_dropout_is_compared_without_it_and_says_so(recipe):
    sft, lora = read_recipe(recipe / "recipe.yaml")
    assert lora["lora_dropout"] == 0.05  # trl sft's default for a recipe that does not set it
    config, p = without_dropout(lora)
    assert p == 0.05 and config.lora_dropout == 0.0 and config.r == 4 and lora["lora_dropout"] == 0.05
    assert "1/(1-p)" in dropout_note(p) and "lora_dropout=0 on both sides" in dropout_note(p)


def test_lora_dropout_and_missing_steps_are_refused(recipe):
    with pytest.raises(RecipeError, match="lora_dropout"):
        trajectory(recipe / "base", chats(), sft_config={}, lora_config={"r": 4, "lora_dropout": 0.1})


def test_what_the_port_cannot_take_is_refused_before_either_side_trains(recipe, monkeypatch):
    """The recipe's optimizer, its LoRA config and its dtype are checked with the tokenizer, template and data,
    before TRL trains (here, training at all fails the test)."""
    import trl

    monkeypatch.setattr(trl.SFTTrainer, "train", lambda self: pytest.fail("the GPU side trained"))
    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {"max_steps": 1}
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(OptimizerConfigError, match="optim"):
        trajectory(recipe / "base", chats(4), sft_config=sft | {"optim": "adafactor"}, lora_config=lora,
                   tokenizer=tokenizer(), progress=False)
    with pytest.raises(LoraError, match="use_dora"):
        trajectory(recipe / "base", chats(4), sft_config=sft, lora_config=lora | {"use_dora": True},
                   tokenizer=tokenizer(), progress=False)
    with pytest.raises(RecipeError, match="dtype 'float16'"):
        trajectory(recipe / "base", chats(4), sft_config=sft, lora_config=lora, dtype="float16")


def test_the_verdict_names_the_first_quantity_beyond_tolerance():
    # Each step is held to FLOOR_MULTIPLE x its own measured floor; a fixed tolerance only when chosen.
    rows = (StepRow(0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.0, LEAST_FLOOR, LEAST_FLOOR),
            StepRow(1, 1e-3, 1e-3, 1.9, 1.9 * (1 + 5e-5), 1.0, 1.01, 1e-6, 5e-4))
    floors = Tolerances()
    report = Trajectory(rows, floors)
    assert not report.ok and report.first_disagreement() == (
        "step 1: loss 1.9001 (port) vs 1.9 (GPU recipe), relative 5.00e-05 = 50 x the floor 1e-06 > 1e-05")
    assert Trajectory(rows, Tolerances(loss=1e-4)).first_disagreement().startswith("step 1: grad_norm 1.01")
    fixed = Tolerances(loss=1e-4, grad_norm=1e-4)  # `--rtol 1e-4`
    assert not Trajectory(rows, fixed).ok and Trajectory(rows, Tolerances(loss=1e-4, grad_norm=2e-2)).ok
    assert Trajectory(rows[:1], floors).ok
    # A floor of 0 (two runs logging the same value to the bit) is one float32 unit: a port one bit off agrees.
    same = StepRow(0, 0.0, 0.0, 2.0, 2.0 * (1 + LEAST_FLOOR), 1.0, 1.0, LEAST_FLOOR, LEAST_FLOOR)
    assert Trajectory((same,), floors).ok
    assert not Trajectory((same._replace(loss_port=2.0 * (1 + 20 * LEAST_FLOOR)),), floors).ok
    # The adapter bound: FLOOR_MULTIPLE x the run's measured floor, unless Tolerances(adapter=) fixes it.
    drifted = Trajectory(rows[:1], Tolerances(), {"layers.0.mlp.up_proj": 1e-3}, adapter_floor=9e-5)
    assert drifted.first_disagreement().startswith("after the last step: adapter layers.0.mlp.up_proj")
    assert Trajectory(rows[:1], Tolerances(), {"layers.0.mlp.up_proj": 1e-3}, adapter_floor=1.1e-4).ok
    assert not Trajectory(rows[:1], Tolerances(adapter=5e-4), {"layers.0.mlp.up_proj": 1e-3}, adapter_floor=1e-3).ok


def test_cli_on_a_miniature_of_the_31b_config(recipe, tmp_path):
    """Only config.json (the gemma4-31b preset's, real sizes) and a tokenizer: the run uses a miniature."""
    from gemport.specs import GemmaSpec

    real = tmp_path / "gemma-4-31b"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(GemmaSpec.preset("gemma4-31b").to_hf_config()))
    tokenizer().save_pretrained(real)
    # Three steps from PEFT's zero B leave B made of a few lr-sized Adam steps, whose signs flip on fp32 noise
    # where gradients are near zero: the adapters are held loosely here, to 10x the floor measured in the 20-step
    # tests below.
    done = run_cli(real, recipe / "data.jsonl", "--config", recipe / "recipe.yaml", "--miniature", "--vocab-size", 256,
                   "--steps", 3, "--rtol", 1e-4, "--adapter-rtol", 1e-2)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("agree within loss 0.0001, grad_norm 0.0001")  # every bound chosen: no second run
    assert [line.split()[0] for line in lines[-5:-2]] == ["0", "1", "2"] and lines[-2].startswith("final adapters")
    # Beside the table: every figure as JSON, and the curves as a PNG.
    report = json.loads((tmp_path / "gemport-parity" / "parity.json").read_text())
    assert report["ok"] and [r["step"] for r in report["steps"]] == [0, 1, 2]
    for r, line in zip(report["steps"], lines[-5:-2]):
        assert f"{r['loss_gpu']:.6f}" == line.split()[2] and f"{r['grad_norm_port']:.6f}" == line.split()[6]
        assert r["loss_floor"] is None and r["loss_bound"] == 1e-4
    assert report["adapter_tolerance"] == 1e-2 and max(report["adapters"].values()) <= 1e-2
    assert_picture(tmp_path / "gemport-parity" / "parity.png", (560, 480))


def test_miniature_keeps_the_head_structure_and_pattern(tmp_path):
    from gemport.check.parity import miniature
    from gemport.specs import GemmaSpec

    full = GemmaSpec.preset("gemma4-31b")
    mini = GemmaSpec.from_hf(miniature(full.to_hf_config(), tmp_path / "mini", vocab_size=128))
    assert (mini.num_heads, mini.num_kv_heads, mini.global_kv_heads, mini.k_eq_v) == (
        full.num_heads, full.num_kv_heads, full.global_kv_heads, full.k_eq_v)
    assert mini.num_layers == 6 and mini.layers_of("global") == (5,) and mini.vocab == 128


@pytest.mark.parametrize("name", ["gemma4-e2b", "gemma4-e4b"])
def test_miniature_of_kv_shared_models_shares_as_hf_does(tmp_path, name):
    """E2B's and E4B's first layers end sliding, global, global (and all sliding): a miniature taking them as they
    are would have KV sharing that Tunix computes unlike HF (a SpecError); its unshared part ends sliding, global."""
    from gemport.check.parity import miniature
    from gemport.specs import GemmaSpec

    full = GemmaSpec.preset(name)
    mini = GemmaSpec.from_hf(miniature(full.to_hf_config(), tmp_path / "mini", vocab_size=128))
    assert mini.layer_types == ("sliding",) * 3 + ("global", "sliding", "global") and mini.num_kv_shared_layers == 2
    assert (mini.per_layer_input_dim > 0, mini.double_wide_mlp, mini.num_kv_heads) == (
        True, full.double_wide_mlp, full.num_kv_heads)


@pytest.mark.parametrize("thinking, packing", [(True, True), (False, False)], ids=["thinking-packed", "plain-padded"])
def test_twenty_steps_agree_on_gemma4(recipe, thinking, packing):
    """The acceptance recipe: 20 steps, accumulation 2, weight decay, clipping, warmup; all seven projections;
    thinking on with packed rows, and thinking off with padded rows."""
    from gemport.data import Gemma4

    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {"max_steps": 20, "packing": packing}
    records = [dict(r, chat_template_kwargs={"enable_thinking": thinking}) for r in chats(24)]
    for r in records[::2]:
        r["messages"][-1]["reasoning"] = "think it over"
    report = trajectory(recipe / "base", records, sft_config=sft, tokenizer=tokenizer(), progress=False,
                        lora_config={"r": 4, "lora_alpha": 8, "target_modules": RECIPE["lora_target_modules"]},
                        chat_format=Gemma4(thinking="on" if thinking else "off"))
    print(report.table())
    assert len(report.rows) == 20 and report.ok, report.table()
    assert len(report.adapters) == 6 * 7 - 1  # k_eq_v global layer 5 has no v_proj


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_twenty_steps_agree_on_a_gemma3_1b_miniature(tmp_path, packing):
    from trl.chat_template_utils import gemma3_training_chat_template

    from gemport.check.parity import miniature
    from gemport.data import Gemma3
    from gemport.specs import GemmaSpec
    from tiny_tokenizers import GEMMA3_CONTROL, char_tokenizer

    base = miniature(GemmaSpec.preset("gemma3-1b").to_hf_config(), tmp_path / "gemma3", vocab_size=256)
    gemma3_tokenizer = char_tokenizer(GEMMA3_CONTROL)
    gemma3_tokenizer.chat_template = gemma3_training_chat_template
    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {"max_steps": 20, "packing": packing}
    report = trajectory(base, chats(24), sft_config=sft, tokenizer=gemma3_tokenizer, chat_format=Gemma3(),
                        lora_config={"r": 4, "lora_alpha": 8, "target_modules": RECIPE["lora_target_modules"]},
                        progress=False)
    print(report.table())
    assert len(report.rows) == 20 and report.ok, report.table()
    assert len(report.adapters) == 6 * 7


def test_prompt_completion_text_needs_no_chat_template(recipe):
    """Plain prompt/completion strings, completion-only loss, a tokenizer without a chat template: TRL takes them
    without one, and so does the port; a conversation is then refused before either side trains."""
    plain = tokenizer()
    plain.chat_template, plain.eos_token = None, "<turn|>"  # a base model's tokenizer: no template, an EOS
    rng = __import__("random").Random(0)
    records = [{"prompt": "Q" + "".join(rng.choice("abcdef ") for _ in range(rng.randint(4, 20))) + "?",
                "completion": " " + "".join(rng.choice("ghijk ") for _ in range(rng.randint(3, 15)))}
               for _ in range(12)]
    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {
        "assistant_only_loss": False, "completion_only_loss": True, "max_steps": 3}
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    report = trajectory(recipe / "base", records, sft_config=sft, lora_config=lora, tokenizer=plain, progress=False)
    print(report.table())
    assert len(report.rows) == 3 and report.ok, report.table()
    with pytest.raises(MaskError, match="record 0: a conversation .* chat template"):
        trajectory(recipe / "base", chats(4), sft_config=sft, lora_config=lora, tokenizer=plain, progress=False)


def test_a_bf16_recipe_agrees_in_bfloat16_against_its_floor(recipe, tmp_path):
    """`bf16: true` and TRL's defaults for the rest (learning rate, schedule, gradient checkpointing, lora_dropout):
    `--dtype bfloat16` trains TRL under torch's CPU bfloat16 autocast on a bfloat16 base and the port on a bfloat16
    base with float32 factors, each step judged against how far TRL's own float32 run lands. The bfloat16 floor
    is coarse: on this random miniature a port taking the loss on every token lands 9.8 x it at step 0 (and
    thousands of times the float32 floor), so float32 stays the default (docs/train.md)."""
    bf16 = {"bf16": True, "max_steps": 3, "per_device_train_batch_size": 2, "max_length": 128,
            "assistant_only_loss": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "down_proj"]}
    (tmp_path / "bf16.yaml").write_text(yaml.safe_dump(bf16))
    done = run_cli(recipe / "base", recipe / "data.jsonl", "--config", tmp_path / "bf16.yaml", "--dtype", "bfloat16")
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-2].startswith("floor: TRL float32 vs bfloat16 (autocast), per step")
    assert lines[-1].startswith("agree within loss 10 x the floor (at most ")
    report = json.loads(Path("gemport-parity/parity.json").read_text())
    assert len(report["steps"]) == 3 and all(r["loss_floor"] > 1e-5 for r in report["steps"])  # bfloat16's rounding


def test_a_real_scale_checkpoint_agrees_against_its_floor(recipe, real_checkpoint, tmp_path):
    """A checkpoint with a real one's magnitudes (logits of order 100, norm gains to 50; `tiny.real_magnitudes`),
    float32: the first step's loss and grad_norm within 10 x the floor of TRL's float32 run against its float64
    one. At these magnitudes most of float32's rounding is outside attention (norms with gains of 50, the loss
    over logits of 100): TRL's eager vs sdpa attention measured a grad_norm floor of 2.5e-7 here, while the port
    lands 9e-6 away, within the whole float32 rounding (2.6e-6 here)."""
    _, real = real_checkpoint("gemma4_mesh")
    base = tmp_path / "real"
    shutil.copytree(real, base)
    tokenizer().save_pretrained(base)
    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {"max_steps": 1, "learning_rate": 2e-4}
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    report = trajectory(base, chats(12), sft_config=sft, lora_config=lora, tokenizer=tokenizer(), progress=False,
                        tolerances=Tolerances(adapter=1.0))  # the per-step floors only
    print(report.table())
    assert report.ok and report.floor_name == "TRL float64 vs float32", report.table()
    assert report.rows[0].loss_gpu > 10  # real-scale logits: a large first loss


def test_a_port_two_parts_in_1e5_off_disagrees_against_the_float32_floor(recipe):
    """A port whose loss is 2e-5 (relative) too large, as a slightly wrong denominator would make it, passes the
    fixed 1e-4 that was float32's default bound, and fails at step 0 against the floor of TRL's float32 run from
    its float64 one (here about one float32 unit of the loss)."""
    from gemport.step import segment_loss

    def off(model, micro_batch):
        total, count = segment_loss(model, micro_batch)
        return total * (1 + 2e-5), count

    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {"max_steps": 1}
    report = trajectory(recipe / "base", chats(8), sft_config=sft, tokenizer=tokenizer(), progress=False, loss_fn=off,
                        lora_config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    print(report.table())
    assert report.floor_name == "TRL float64 vs float32"
    assert report.first_disagreement().startswith("step 0: loss"), report.table()
    assert Trajectory(report.rows, Tolerances(loss=1e-4, grad_norm=1e-4), report.adapters, report.adapter_floor).ok
