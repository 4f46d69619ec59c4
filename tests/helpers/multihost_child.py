"""One process of a training run for tests/run/test_multihost.py, alone (8 devices) or under jax.distributed (4 each).

    python multihost_child.py PORT PROCESS_ID NUM_PROCESSES OUT JOB [JOB ...]      JOB = LOOP:PATH:NAME[:TERM_AFTER]

LOOP is ``nnx`` (the user's loop: step.train_step, Tunix's CheckpointManager, run.preemption.Preemption;
PATH the tiny Gemma's HF directory) or ``sft`` (``gemport sft --config PATH --output_dir OUT/NAME --merge`` on
the same 8-device fsdp mesh, run in this process; as the first job of a multi-process launch it is given
``--coordinator-address``, ``--num-processes`` and ``--process-id`` and joins the processes itself, for the
jobs after it too).

An ``nnx`` job trains the tiny Gemma with LoRA for STEPS optimizer steps of 2 micro-batches of 8 packed rows
on an 8-device fsdp mesh; every process lays out only its own rows of HF's batches (data.distributed). It
checkpoints every 2 steps into OUT/NAME/checkpoints and resumes from there. Process 0 appends one line per
trained step to OUT/NAME/log.jsonl (step, loss, grad_norm, the micro-batches by index) and at the end writes
OUT/NAME/lora.npz. An ``sft`` job leaves what ``gemport sft`` leaves in OUT/NAME. With TERM_AFTER every
process sends itself SIGTERM after that step: the run saves at the step all processes agree on and exits
with status 143.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, num_processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
SFT_FIRST = sys.argv[5].startswith("sft:")
if num_processes > 1 and not SFT_FIRST:
    jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from tunix.sft import checkpoint_manager  # noqa: E402

from gemport.data import optimizer_steps, pack, stack

from gemport.step import train_step
from gemport.checkpoint import load_model, save_lora_spec  # noqa: E402
from gemport.lora import LoraSpec, apply_lora  # noqa: E402
from gemport.mesh import make_mesh  # noqa: E402
from gemport.optim import hf_optimizer  # noqa: E402
from gemport.specs import GemmaSpec  # noqa: E402
from gemport.data.distributed import batch_sharding, global_batch, process_rows, process_step  # noqa: E402
from gemport.run.preemption import Preempted, Preemption  # noqa: E402

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
    return pack([(t, np.arange(len(t)) >= int(rng.integers(1, len(t)))) for t in tokens], SEQ)


def local_steps(rows, sharding):
    """This process's rows of every step's batch [A, B_p, SEQ], with the global steps' sample indices."""
    plan = list(optimizer_steps(ARGS, len(rows["tokens"])))
    mine = process_rows(sharding, (ACCUMULATION, ROWS, SEQ))
    batches = []
    for s in plan:
        part = process_step(s, mine)
        batches.append(stack([{k: v[m] for k, v in rows.items()} for m in part.micro_batches],
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
    optimizer = nnx.Optimizer(model, hf_optimizer(ARGS, num_training_steps=STEPS).tx, wrt=nnx.LoRAParam)
    manager = checkpoint_manager.CheckpointManager(str(out / "checkpoints"), OPTIONS)
    save_lora_spec(out / "checkpoints", LORA)
    start, _ = manager.maybe_restore(model, optimizer, restore_only_lora_params=True)
    step_fn = train_step(wrt=nnx.LoRAParam)
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


def sft(config, run, term_after, first):
    from gemport.cli import main as gemport
    from sft_child import signal_after

    if term_after:
        signal_after("term", term_after)
    join = ["--coordinator-address", f"localhost:{port}", "--num-processes", str(num_processes),
            "--process-id", str(process_id)] if first and num_processes > 1 else []
    code = gemport(["sft", "--config", config, "--output_dir", str(run), "--merge", "--fsdp", "8", "--tp", "1",
                    *join])
    if code:
        sys.exit(code)


def main(out, *jobs):
    for index, job in enumerate(jobs):
        loop, hf_dir, name, *term = job.split(":")
        run = Path(out) / name
        if loop == "sft":
            sft(hf_dir, run, int(term[0]) if term else None, index == 0)
            continue
        run.mkdir(parents=True, exist_ok=True)
        spec = GemmaSpec.from_hf(hf_dir)
        mesh = make_mesh(spec, fsdp=jax.device_count(), tp=1)
        with jax.set_mesh(mesh):
            model = apply_lora(load_model(hf_dir, mesh=mesh, param_dtype=jnp.float32), spec, LORA, seed=3)
            try:
                nnx_loop(model, mesh, packed_rows(spec.vocab), run, int(term[0]) if term else None)
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
