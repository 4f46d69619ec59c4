"""``gradient_checkpointing: true`` keeps what fits (``step.fit``): the trainer's first step takes the first remat of
``SFTRun.remats`` XLA compiles within the devices' memory, says which, and trains as that remat trains.

On this CPU host XLA refuses nothing, so the refusal a TPU gives a step past its HBM (libtpu's RESOURCE_EXHAUSTED,
raised before anything runs) is raised here where the step is traced under "projections"; the TPU tier and
``bench/bench_tpu.py`` meet libtpu's own.
"""

import json

import jax
import numpy as np
import pytest

from gemport import SFTRun
from gemport.mesh import make_mesh
from gemport.run.trainer import HFPeftTrainer
from gemport.specs import GemmaSpec
from gemport.step.fit import FIT, fit_remats
from gemport.lora import LoraSpec
from chats import chats, tokenizer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
ARGS = dict(assistant_only_loss=True, packing=True, max_length=64, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=2, learning_rate=5e-3, seed=3, save_strategy="no",
            logging_steps=1)
HBM = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm."


def _losses(base, tmp_path, name, remats):
    mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=1, tp=1, devices=jax.devices()[:1])
    run = SFTRun.create({**ARGS, "output_dir": str(tmp_path / name)}, base, chats(8), lora=LORA,
                        tokenizer=tokenizer(), mesh=mesh, progress=False)
    assert run.remats == ("decoder",)  # TRL's default gradient_checkpointing on a CPU: decoder remat, no choice
    run.remats = remats
    trainer = run.train()
    state = json.loads((tmp_path / name / "trainer_state.json").read_text())
    return trainer.remat, [(e["loss"], e["grad_norm"]) for e in state["log_history"] if "grad_norm" in e]


def test_a_remat_xla_refuses_gives_way_to_the_next_which_trains_and_is_said(hf_checkpoint, tmp_path, monkeypatch,
                                                                             capsys):
    _, base = hf_checkpoint("gemma4_mesh")
    real = HFPeftTrainer.create_train_step_fn

    def refusing(self):
        step = real(self)

        def train_step(model, optimizer, inputs):
            if model.remat == "projections":  # as libtpu refuses a program past the chip's HBM
                raise jax.errors.JaxRuntimeError(HBM)
            return step(model, optimizer, inputs)

        return train_step

    decoder = _losses(base, tmp_path, "decoder", ())
    capsys.readouterr()
    monkeypatch.setattr(HFPeftTrainer, "create_train_step_fn", refusing)
    fit = _losses(base, tmp_path, "fit", FIT)
    out = capsys.readouterr().out
    assert fit[0] == "decoder" and decoder[0] == "decoder"
    assert "the step trains under remat decoder" in out and "projections refused: RESOURCE_EXHAUSTED" in out, out
    assert len(fit[1]) == ARGS["max_steps"]
    np.testing.assert_array_equal(fit[1], decoder[1])  # the same program: the same arithmetic, bit for bit


def test_any_other_error_is_raised_at_once(hf_checkpoint, tmp_path, monkeypatch):
    _, base = hf_checkpoint("gemma4_mesh")
    tried = []

    def failing(self):
        def train_step(model, optimizer, inputs):
            tried.append(model.remat)
            raise jax.errors.JaxRuntimeError("INTERNAL: not a question of memory")

        return train_step

    monkeypatch.setattr(HFPeftTrainer, "create_train_step_fn", failing)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        _losses(base, tmp_path, "fit", FIT)
    assert set(tried) == {"projections"}


@pytest.mark.parametrize("preset, remat, platform, want", [
    ("gemma3-1b", "decoder", "tpu", FIT),
    ("gemma4-31b", "decoder", "tpu", FIT),
    ("gemma4-e4b", "decoder", "tpu", ("decoder",)),  # per-layer inputs and KV sharing: the decoder keeps its loop
    ("gemma3-1b", "decoder", "cpu", ("decoder",)),
    ("gemma3-1b", "decoder", "gpu", ("decoder",)),
    ("gemma3-1b", "none", "tpu", ("none",)),  # gradient_checkpointing: false is none, everywhere
])
def test_what_gradient_checkpointing_tries(preset, remat, platform, want):
    assert fit_remats(remat, GemmaSpec.preset(preset), LoraSpec(rank=16), platform) == want


@pytest.mark.parametrize("remats", [FIT, ()], ids=["fit", "no choice"])
def test_a_step_refused_under_every_remat_is_an_error_saying_what_to_change(hf_checkpoint, tmp_path, monkeypatch,
                                                                           remats):
    """Past the last remat (or with none to choose, as on CPU and GPU) XLA's refusal is a BatchError naming the
    micro-batch, the mesh and what to change, as the dry run's (tests/plan/test_dry_run.py), not libtpu's error."""
    from gemport.errors import BatchError

    _, base = hf_checkpoint("gemma4_mesh")
    tried = []

    def refusing(self):
        def train_step(model, optimizer, inputs):
            tried.append(model.remat)
            raise jax.errors.JaxRuntimeError(HBM)

        return train_step

    monkeypatch.setattr(HFPeftTrainer, "create_train_step_fn", refusing)
    with pytest.raises(BatchError) as caught:
        _losses(base, tmp_path, "refused", remats)
    assert tried == list(remats or ["decoder"])
    for said in ("2 rows x 64 tokens per micro-batch", "fsdp=1 tp=1", "remat decoder",
                 "does not fit the chips' memory (libtpu: RESOURCE_EXHAUSTED", "per_device_train_batch_size 2",
                 "a shorter max_length"):
        assert said in str(caught.value), caught.value
