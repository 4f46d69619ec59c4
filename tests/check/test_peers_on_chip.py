"""The port on the chip against its peers on the host's CPU (the TPU tier, ``GEMPORT_TPU=1``, with TRL and PEFT
installed: ``tools/tpu/prepare.sh --peers``).

On a miniature of Gemma 4 31B (head widths 128/256, so splash attention runs as at full size):
- ``gemport parity`` (``check.parity.trajectory``): TRL + PEFT on the CPU against the port on the chip, a doc-style
  recipe in float32 and in bfloat16, each judged against the floor measured in that run; a port whose learning
  rate is changed fails;
- the step ``SFTRun`` trains, on the chip and on the CPU, from the same adapter on the same batches: every step's
  loss and grad_norm within ``on_chip.MULTIPLE`` x the same floors;
- ``gemport verify`` (``check.verify.compare_logits``): the base's logits on the chip against transformers'.
"""

import functools
import json

import jax
import jax.numpy as jnp
import pytest
from chats import chats, tokenizer
from on_chip import MULTIPLE, chip, cpu, judged, record

from gemport.check.frame import Setup, peft_config
from gemport.check.parity import miniature, trajectory
from gemport.check.verify import compare_logits
from gemport.checkpoint import load_model
from gemport.mesh import make_mesh
from gemport.run import SFTRun
from gemport.specs import GemmaSpec
from gemport.step import hf
from gemport.step.attention import segment_attention_model

pytestmark = pytest.mark.tpu

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}
RECIPE = dict(assistant_only_loss=True, packing=True, max_length=256, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, max_steps=4, learning_rate=2e-3, lr_scheduler_type="cosine",
              warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, seed=42, logging_steps=1, save_strategy="no")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    config = GemmaSpec.preset("gemma4-31b").to_hf_config()
    return miniature(config, tmp_path_factory.mktemp("chip") / "base", num_layers=6, hidden_size=256, head_dim=128,
                     sliding_window=128, vocab_size=len(tokenizer()))


# TRL's bfloat16 run on a TPU host's CPU takes torch's generic bfloat16 product (cpublas_gemm_impl): 110-120 s a step
# on the lent v5e machine, where its float32 run takes 6 s. The bfloat16 recipe therefore trains 2 steps without
# warmup, so its second step's loss and grad_norm are of the adapter its first step moved.
BF16_RECIPE = dict(RECIPE, bf16=True, max_steps=2, warmup_steps=0)

TILES = 128
"""The blockwise attention's tile the bfloat16 step's own spread is measured at (RECIPE's rows: two tiles of 128,
where the default tile, ``step.attention.BLOCK``, is the whole row)."""


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def parity(request, base):
    dtype = request.param
    recipe = BF16_RECIPE if dtype == "bfloat16" else {**RECIPE, "bf16": False}
    with jax.default_device(chip()):
        report = trajectory(base, chats(24), sft_config=recipe, lora_config=LORA, tokenizer=tokenizer(), dtype=dtype,
                            progress=False)
    return dtype, recipe, report


def worst_multiple(report):
    return max(max(abs(r.loss_port - r.loss_gpu) / abs(r.loss_gpu) / r.loss_floor,
                   abs(r.grad_norm_port - r.grad_norm_gpu) / abs(r.grad_norm_gpu) / r.grad_norm_floor)
               for r in report.rows)


def test_parity_holds_with_the_port_on_the_chip(parity):
    dtype, _, report = parity
    print(report.table())
    record("parity", f"doc recipe {dtype}", worst_multiple(report), 1.0, MULTIPLE, floor_name=report.floor_name,
           dtype=dtype, adapter=max(report.adapters.values()), adapter_floor=report.adapter_floor)
    assert report.ok, report.first_disagreement()


def test_a_port_with_another_learning_rate_fails_on_the_chip(base):
    recipe = {**RECIPE, "bf16": False}
    with jax.default_device(chip()):
        report = trajectory(base, chats(24), sft_config=recipe, lora_config=LORA, tokenizer=tokenizer(),
                            port_sft_config={**recipe, "learning_rate": 1.2 * RECIPE["learning_rate"]}, steps=2,
                            progress=False)
    # Recorded in units of each quantity's own bound, the farthest beyond it: parity refuses the port at the
    # learning rate it logs (bound 1e-6, the schedules' arithmetic), before two steps move the loss or grad_norm
    # past their floors (loss_grad_multiple: 2.6 x the floor on the chip, under MULTIPLE).
    beyond = max((rel / bound for *_, rel, bound in report.disagreements()), default=0.0)
    record("parity", "learning rate x1.2 fails", beyond, 1.0, 1.0, expect="fail", found=report.first_disagreement(),
           ok=not report.ok, loss_grad_multiple=worst_multiple(report))
    assert not report.ok


def test_the_trained_step_on_the_chip_follows_the_cpus(parity, base, tmp_path, monkeypatch):
    """SFTRun's step (HFPeftTrainer) on the same batches, on the chip and on the CPU, from parity's step-0 adapter
    (so the trajectory is the one parity's floors are of: from SFTRun's own initialisation, the CPU's float32 steps
    with and without remat were already 2.4x the step-2 loss floor of TRL's trajectory apart); each step's loss and
    grad_norm within MULTIPLE x the floor parity measured for that step (TRL float64 vs float32 for the float32
    recipe, TRL float32 vs bfloat16 for the bfloat16 one).

    The bfloat16 step's floor is also its own spread across attention tiles: the chip's splash kernels sum the
    scores in another order than the CPU's blockwise path, and gemport's step is bfloat16 throughout (TRL's
    autocast keeps the residual stream in float32), so an order moves its first grad_norm by several times TRL's
    floor. Measured in the same run: the CPU's step again with 128-row tiles (the rows are 256 tokens, one tile by
    default), each quantity's floor the larger of the two (docs/tpu.md, "The bfloat16 step's own spread")."""
    dtype, recipe, report = parity
    start = Setup(base, [], tokenizer(), tmp_path, {}, dtype, None)
    start.write_start(peft_config(LORA), recipe["seed"])
    runs = [("chip", chip(), None), ("cpu", cpu(), None)] + ([("cpu tiles", cpu(), TILES)] if recipe["bf16"] else [])
    logs = {}
    for name, device, block in runs:
        if block is not None:  # the blockwise attention's tile, which SFTRun's step leaves at its default
            monkeypatch.setattr(hf, "segment_attention_model", functools.partial(segment_attention_model, block=block))
        mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=1, tp=1, devices=[device])
        run = SFTRun.create({**recipe, "output_dir": str(tmp_path / name)}, base, chats(24), lora=LORA,
                            tokenizer=tokenizer(), mesh=mesh, dtype=jnp.bfloat16 if recipe["bf16"] else jnp.float32,
                            progress=False, init_adapter=start.start)
        run.train()
        state = json.loads((tmp_path / name / "trainer_state.json").read_text())
        logs[name] = [(e["loss"], e["grad_norm"]) for e in state["log_history"] if "loss" in e and "grad_norm" in e]
    assert all(len(log) == len(report.rows) for log in logs.values())
    tiles = logs.get("cpu tiles", logs["cpu"])
    verdicts = []
    for step, (a, b, t, row) in enumerate(zip(logs["chip"], logs["cpu"], tiles, report.rows)):
        for i, (quantity, trl_floor) in enumerate((("loss", row.loss_floor), ("grad_norm", row.grad_norm_floor))):
            spread = abs(t[i] - b[i]) / abs(b[i])
            verdicts.append(judged("trained_step", f"{dtype} step {step} {quantity}", abs(a[i] - b[i]) / abs(b[i]),
                                   max(trl_floor, spread), 0.0, dtype=dtype, step=step, quantity=quantity,
                                   trl_floor=trl_floor, tiles_spread=spread if recipe["bf16"] else None))
    assert all(verdicts)  # each step is recorded, whichever fails


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_on_the_chip(base, dtype):
    with jax.default_device(chip()):
        model = load_model(base, param_dtype=dtype)
        report = compare_logits(base, model, dtype=dtype, seq_len=64)
    print(report)
    assert judged("verify", f"base logits {dtype}", report.max_abs_diff, report.floor, 0.0,
                  floor_name=report.floor_name, dtype=dtype, max_abs_logit=report.max_abs_logit)
