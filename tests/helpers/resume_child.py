"""A training process for tests/run/test_resume.py: run, optionally SIGKILL itself, restart from the last checkpoint.

    python resume_child.py HF_DIR JOB [JOB ...]      JOB = LOOP:DIR[:KILL_AFTER]

LOOP is ``peft`` (gemport.run.trainer.HFPeftTrainer) or ``nnx`` (the user's own loop with
gemport.step.train_step and Tunix's CheckpointManager). Each job trains a tiny Gemma 3 with LoRA (dropout
DROPOUT[LOOP]) for STEPS optimizer steps of 2 micro-batches, checkpointing into DIR/checkpoints (every EVERY[LOOP]
steps, asynchronously: Orbax's default), resuming from the latest checkpoint there if any. It appends to DIR/log.jsonl one line per optimizer step trained: the step, its loss
and the micro-batches (by index in the run's data) it consumed; at the end it writes DIR/lora.npz. With
KILL_AFTER, once step KILL_AFTER has been trained (and the previous checkpoint is on disk) the process kills
itself with SIGKILL: no exit handler, no flush, no final checkpoint.
"""

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tunix.sft import checkpoint_manager, hooks
from tunix.sft.peft_trainer import TrainingConfig

from gemport.data import optimizer_steps, pack, stack

from gemport.step import train_step
from gemport.checkpoint import load_model
from gemport.lora import LoraSpec, apply_lora
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec
from gemport.run.trainer import HFPeftTrainer, micro_batches

STEPS = 5
# The PeftTrainer loop checkpoints every step: each save is still being written while the next step runs with the
# model and optimizer donated (HFPeftTrainer.jitted_train_step), so a save that read a donated buffer after
# returning would fail or write other values, and the resume would differ.
EVERY = {"peft": 1, "nnx": 2}
ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=5e-3,
            weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=1, seed=7)
LORA = LoraSpec.from_peft({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]})
# The PeftTrainer loop (gemport sft's) trains with TRL's default LoRA dropout, whose masks a resume must redraw;
# the nnx loop without.
DROPOUT = {"peft": 0.05, "nnx": 0.0}


def options(loop):
    return ocp.CheckpointManagerOptions(save_interval_steps=EVERY[loop], max_to_keep=2)


def data(vocab):
    """Step batches [2, 2, 12] of packed random rows in HF's order: STEPS steps and then some."""
    rng = np.random.default_rng(1)
    tokens = [rng.integers(1, vocab, int(n)).astype(np.int32) for n in rng.integers(4, 13, 30)]
    loss_mask = [np.arange(len(t)) >= len(t) // 2 for t in tokens]
    rows = pack(list(zip(tokens, loss_mask)), 12)
    return [stack([{k: v[m] for k, v in rows.items()} for m in s.micro_batches], accumulation=2, rows=2)
            for s in optimizer_steps({**ARGS, "max_steps": None, "num_train_epochs": 2}, len(rows["tokens"]))]


def log(out, record):
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def die(manager):
    manager.wait_until_finished()  # the checkpoint before the kill is complete: the restart point is known
    os.kill(os.getpid(), signal.SIGKILL)


class Recorder(hooks.TrainingHooks):
    """Logs each step's loss with the micro-batches it consumed, and kills the process after a chosen step."""

    def __init__(self, out, kill_after):
        self.out, self.kill_after, self.consumed = out, kill_after, {}

    def on_train_step_end(self, trainer, train_step, train_loss):
        log(self.out, {"step": int(train_step), "loss": float(train_loss),
                       "micro_batches": self.consumed.pop(int(train_step))})
        if train_step == self.kill_after:
            die(trainer.checkpoint_manager._checkpoint_manager)

    def on_train_start(self, trainer): ...
    def on_train_end(self, trainer): ...
    def on_train_step_start(self, trainer): ...
    def on_eval_step_start(self, trainer): ...
    def on_eval_step_end(self, trainer, eval_loss): ...


class RecordingTrainer(HFPeftTrainer):
    def prepare_inputs(self, input_data, training):
        # Called for the micro-batches trained, not for those skipped on resume.
        index = int(input_data.pop("index")[0])
        self.training_hooks.consumed.setdefault(self.train_steps + 1, []).append(index)
        return super().prepare_inputs(input_data, training)


def peft(model, steps, out, kill_after):
    config = TrainingConfig(eval_every_n_steps=STEPS + 1, max_steps=STEPS, gradient_accumulation_steps=2,
                            checkpoint_root_directory=str(out / "checkpoints"), checkpointing_options=options("peft"),
                            pbar_description=None)
    trainer = RecordingTrainer(model, hf_optimizer(ARGS, num_training_steps=STEPS).tx, config,
                               lora_spec=model.lora_spec, seed=ARGS["seed"])
    trainer.with_training_hooks(Recorder(out, kill_after))
    dataset = micro_batches(steps).map_with_index(lambda i, b: {**b, "index": np.full(2, i, np.int32)})
    trainer.train(dataset)


def nnx_loop(model, steps, out, kill_after):
    optimizer = nnx.Optimizer(model, hf_optimizer(ARGS, num_training_steps=STEPS).tx, wrt=nnx.LoRAParam)
    manager = checkpoint_manager.CheckpointManager(str(out / "checkpoints"), options("nnx"))
    start, _ = manager.maybe_restore(model, optimizer, restore_only_lora_params=True)
    step_fn = train_step(wrt=nnx.LoRAParam)
    for s in range(start, STEPS):  # the data position is the optimizer step: HF's order is a function of it
        metrics = step_fn(model, optimizer, steps[s])
        log(out, {"step": s + 1, "loss": float(metrics.loss), "micro_batches": [2 * s, 2 * s + 1]})
        manager.save(s + 1, model, optimizer, save_only_lora_params=True)
        if s + 1 == kill_after:
            die(manager._checkpoint_manager)
    manager.save(STEPS, model, optimizer, save_only_lora_params=True, force=True)
    manager.close()


def main(hf_dir, *jobs):
    spec = GemmaSpec.from_hf(hf_dir)
    steps = data(spec.vocab)
    for job in jobs:
        loop, out, *kill = job.split(":")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        lora = dataclasses.replace(LORA, dropout=DROPOUT[loop])
        model = apply_lora(load_model(hf_dir, param_dtype=jnp.float32), spec, lora, seed=3)
        {"peft": peft, "nnx": nnx_loop}[loop](model, steps, out, int(kill[0]) if kill else None)
        lora = {".".join(map(str, path)): np.asarray(v.get_value())
                for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
        np.savez(out / "lora.npz", **lora)


if __name__ == "__main__":
    main(*sys.argv[1:])
