"""gemport.SFTRun: one SFTConfig drives the model with LoRA, the batches, the optimizer and the Tunix trainer."""

import dataclasses

import jax
import numpy as np
import pytest

from gemport import SFTRun
from gemport.checkpoint import load_lora
from gemport.errors import BatchError, RecipeError
from gemport.mesh import make_mesh
from gemport.specs import GemmaSpec
from gemport.run.trainer import HFPeftTrainer
from gemport.run.sft import eval_batches
from chats import chats, tokenizer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
ARGS = dict(assistant_only_loss=True, packing=True, max_length=64, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3, seed=3, save_strategy="no",
            eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)


@pytest.fixture(scope="module")
def run(hf_checkpoint):
    _, base = hf_checkpoint("gemma4_mesh")
    mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=1, tp=1, devices=jax.devices()[:1])
    return SFTRun.create(ARGS, base, chats(12), eval_dataset=chats(5, seed=1), lora=LORA, tokenizer=tokenizer(),
                         mesh=mesh, progress=False)


def test_every_fact_comes_from_the_sft_config(run):
    assert run.max_steps == len(run.plan) == run.training_config.max_steps == ARGS["max_steps"]
    assert run.training_config.gradient_accumulation_steps == 2 and run.training_config.eval_every_n_steps == 2
    assert {b["tokens"].shape for b in run.train_batches} == {(2, 2, 64)}
    assert float(run.optimizer.schedule(0)) == pytest.approx(5e-3 * (1 - 0 / 3))  # HF's linear decay from 0
    assert run.lora_spec.rank == 4 and run.model.lora_spec == run.lora_spec
    assert load_lora(run.model).lora_spec == run.lora_spec  # the exports' reader needs no lora_spec=


def test_eval_batches_keep_the_odd_last_example(run):
    assert len(run.eval_examples) == 5 and len(run.eval_batches) == 3
    rows = np.concatenate([b["loss_mask"][0] for b in run.eval_batches])
    assert rows.shape[0] == 6 and rows.any(axis=1).sum() == 5  # five examples, one empty padding row
    with pytest.raises(RecipeError, match="no eval example"):
        eval_batches([], 2)


def test_trainer_refuses_batches_laid_out_for_another_accumulation(run):
    config = dataclasses.replace(run.training_config, gradient_accumulation_steps=1)
    other = dataclasses.replace(run, training_config=config, trainer=None)
    with pytest.raises(BatchError, match="gradient_accumulation_steps=2 but TrainingConfig"):
        other.train()
    assert isinstance(other.trainer, HFPeftTrainer)


def test_a_trl_yaml_is_read_as_trl_sft_reads_it(tmp_path):
    import yaml

    from gemport.run.sft import sft_fields

    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({**ARGS, "use_peft": True, "lora_target_modules": ["q_proj"]}))
    fields = sft_fields(path)
    assert fields["max_steps"] == 3 and fields["learning_rate"] == 5e-3
    assert fields["logging_steps"] == 10 and fields["num_train_epochs"] == 3.0  # TRL's defaults for the rest
    path.write_text(yaml.safe_dump({**ARGS, "fsdp": "full_shard"}))
    with pytest.raises(RecipeError, match="fsdp='full_shard'"):
        sft_fields(path)
