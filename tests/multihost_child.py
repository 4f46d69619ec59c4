"""One process of a training run for tests/test_multihost.py, alone (8 devices) or under jax.distributed (4 each).

    python multihost_child.py PORT PROCESS_ID NUM_PROCESSES OUT JOB [JOB ...]      JOB = LOOP:HF_DIR:NAME[:TERM_AFTER]

LOOP is ``nnx`` (the user's loop: train.train_step, Tunix's CheckpointManager, train.preemption.Preemption) or
``peft`` (HFPeftTrainer with ``preemption=``). Each job trains the tiny Gemma at HF_DIR with LoRA for STEPS
optimizer steps of 2 micro-batches of 8 packed rows on an 8-device fsdp mesh; every process lays out only its
own rows of HF's batches (train.distributed). It checkpoints every 2 steps into OUT/NAME/checkpoints and
resumes from there. Process 0 appends one line per trained step to OUT/NAME/log.jsonl (step, loss, grad_norm,
the micro-batches by index) and at the end writes OUT/NAME/lora.npz. With TERM_AFTER every process sends
itself SIGTERM after that step: the run saves at the step all processes agree on and exits with status 143.
"""

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, num_processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if num_processes > 1:
    jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from tunix.sft import checkpoint_manager, hooks  # noqa: E402
from tunix.sft.peft_trainer import TrainingConfig  # noqa: E402

from gemport import masks, train  # noqa: E402
from gemport.checkpoint import load_model, save_lora_spec  # noqa: E402
from gemport.lora import LoraSpec, apply_lora  # noqa: E402
from gemport.mesh import make_mesh  # noqa: E402
from gemport.specs import GemmaSpec  # noqa: E402
from gemport.train.distributed import batch_sharding, global_batch, process_rows, process_step  # noqa: E402
from gemport.train.peft_trainer import micro_batches  # noqa: E402
from gemport.train.preemption import Preempted, Preemption  # noqa: E402
from resume_child import RecordingTrainer  # noqa: E402

STEPS, EVERY, ROWS, ACCUMULATION, SEQ = 5, 2, 8, 2, 12
# adam_epsilon: Adam moves an element whose gradient is fp32 noise by ~lr (lr * sign(g)); a larger epsilon
# keeps such elements still, so LoRA params trained with reductions in another order compare at 1e-5.
ARGS = dict(per_device_train_batch_size=ROWS, gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS,
            learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=1,
            seed=7, adam_epsilon=1e-3)
LORA = LoraSpec.from_peft({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]})
OPTIONS = ocp.CheckpointManagerOptions(save_interval_steps=EVERY, max_to_keep=2)


def packed_rows(vocab):
    """Packed rows of random examples (a random tail of each trained): about two steps an epoch."""
    rng = np.random.default_rng(1)
    tokens = [rng.integers(1, vocab, int(n)).astype(np.int32) for n in rng.integers(4, SEQ + 1, 40)]
    return masks.pack([(t, np.arange(len(t)) >= int(rng.integers(1, len(t)))) for t in tokens], SEQ)


def local_steps(rows, sharding):
    """This process's rows of every step's batch [A, B_p, SEQ], with the global steps' sample indices."""
    plan = list(train.optimizer_steps(ARGS, len(rows["tokens"])))
    mine = process_rows(sharding, (ACCUMULATION, ROWS, SEQ))
    batches = []
    for s in plan:
        part = process_step(s, mine)
        batches.append(train.stack([{k: v[m] for k, v in rows.items()} for m in part.micro_batches],
                                   accumulation=ACCUMULATION, rows=mine.stop - mine.start))
    return plan, batches, mine


def log(out, record):
    if jax.process_index() == 0:
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def term_self():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)  # lets JAX's preemption service tell the other process before the next step's check


def nnx_loop(model, mesh, rows, out, term_after):
    sharding = batch_sharding(mesh)
    plan, batches, _ = local_steps(rows, sharding)
    optimizer = nnx.Optimizer(model, train.hf_optimizer(ARGS, num_training_steps=STEPS).tx, wrt=nnx.LoRAParam)
    manager = checkpoint_manager.CheckpointManager(str(out / "checkpoints"), OPTIONS)
    save_lora_spec(out / "checkpoints", LORA)
    start, _ = manager.maybe_restore(model, optimizer, restore_only_lora_params=True)
    step_fn = train.train_step(wrt=nnx.LoRAParam)
    with Preemption() as preemption:
        for s in range(start, STEPS):  # the data position is the optimizer step: HF's order is a function of it
            metrics = step_fn(model, optimizer, global_batch(batches[s], sharding, ROWS))
            log(out, {"step": s + 1, "loss": float(metrics.loss), "grad_norm": float(metrics.grad_norm),
                      "samples": [m.tolist() for m in plan[s].micro_batches]})
            if s + 1 == term_after:
                term_self()
            preemption.check(s + 1, lambda: (manager.save(s + 1, model, optimizer, save_only_lora_params=True,
                                                          force=True), manager.close()), where=str(out / "checkpoints"))
            manager.save(s + 1, model, optimizer, save_only_lora_params=True)
    manager.save(STEPS, model, optimizer, save_only_lora_params=True, force=True)
    manager.close()


class Recorder(hooks.TrainingHooks):
    def __init__(self, out, term_after):
        self.out, self.term_after, self.consumed = out, term_after, {}

    def on_train_step_end(self, trainer, train_step, train_loss):
        log(self.out, {"step": int(train_step), "loss": float(train_loss),
                       "micro_batches": self.consumed.pop(int(train_step))})
        if train_step == self.term_after:
            term_self()

    def on_train_step_start(self, trainer): ...

    def on_train_start(self, trainer): ...
    def on_train_end(self, trainer): ...
    def on_eval_step_start(self, trainer): ...
    def on_eval_step_end(self, trainer, eval_loss): ...




def peft(model, mesh, rows, out, term_after):
    _, batches, _ = local_steps(rows, batch_sharding(mesh))
    config = TrainingConfig(eval_every_n_steps=STEPS + 1, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION,
                            checkpoint_root_directory=str(out / "checkpoints"), checkpointing_options=OPTIONS,
                            max_inflight_computations=1, pbar_description=None)
    trainer = RecordingTrainer(model, train.hf_optimizer(ARGS, num_training_steps=STEPS).tx, config, lora_spec=LORA,
                               preemption=Preemption())
    trainer.with_training_hooks(Recorder(out, term_after))
    dataset = micro_batches(batches).map_with_index(lambda i, b: {**b, "index": np.full(len(b["tokens"]), i, np.int32)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` is PeftTrainer's way to find it
        with mesh:
            trainer.train(dataset)


def main(out, *jobs):
    for job in jobs:
        loop, hf_dir, name, *term = job.split(":")
        run = Path(out) / name
        run.mkdir(parents=True, exist_ok=True)
        spec = GemmaSpec.from_hf(hf_dir)
        mesh = make_mesh(spec, fsdp=jax.device_count(), tp=1)
        with jax.set_mesh(mesh):
            model = apply_lora(load_model(hf_dir, mesh=mesh, param_dtype=jnp.float32), spec, LORA, seed=3)
            try:
                {"nnx": nnx_loop, "peft": peft}[loop](model, mesh, packed_rows(spec.vocab), run,
                                                      int(term[0]) if term else None)
            except Preempted as e:
                print(e, file=sys.stderr, flush=True)
                sys.exit(e.exit_code)
            lora = multihost_utils.process_allgather(
                {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))},
                tiled=True)
        if jax.process_index() == 0:
            np.savez(run / "lora.npz", **lora)


if __name__ == "__main__":
    main(*sys.argv[4:])
