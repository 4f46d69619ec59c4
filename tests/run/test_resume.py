"""A training run SIGKILLed between checkpoints and restarted continues exactly as if never interrupted.

Both loops: Tunix's PeftTrainer driven by gemport (HFPeftTrainer) and the user's own nnx loop with
step.train_step and Tunix's CheckpointManager. tests/helpers/resume_child.py trains a tiny Gemma 3 with LoRA for 5
steps of 2 micro-batches, checkpointing asynchronously, and kills itself with SIGKILL once step 3 is logged. The
PeftTrainer loop checkpoints every step: each step donates the model and optimizer while the previous step's save
is being written, and Tunix logs a step after the next one has trained, so it dies with checkpoint 3 on disk and
step 4 trained but not saved. The nnx loop checkpoints every 2 steps: it dies with checkpoint 2 on disk. The
restarted run's losses and final LoRA params are bit-identical to an uninterrupted run's, and every micro-batch is
trained exactly once, in the same order. The PeftTrainer loop trains with LoRA dropout 0.05 (TRL's default): the
resumed run draws the uninterrupted run's masks.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
from repo_paths import HELPERS

CHILD = HELPERS / "resume_child.py"
KILL_AFTER = 3
RESTART = {"peft": 4, "nnx": 3}  # the step the restarted run trains first: after checkpoint 3, or 2


def run(hf_dir, *jobs, env):
    return subprocess.run([sys.executable, str(CHILD), str(hf_dir), *jobs], env=env, cwd=CHILD.parent,
                          capture_output=True, text=True, timeout=600)


def log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_resume_after_sigkill_continues_exactly(hf_checkpoint, tmp_path):
    _, hf_dir = hf_checkpoint("gemma3_1b")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               # Restarts load the first process's executables instead of compiling again.
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    ref, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    # Three processes: each ends with the job that kills it.
    first = run(hf_dir, f"nnx:{ref / 'nnx'}", f"peft:{killed / 'peft'}:{KILL_AFTER}", env=env)
    second = run(hf_dir, f"peft:{killed / 'peft'}", f"nnx:{killed / 'nnx'}:{KILL_AFTER}", env=env)
    third = run(hf_dir, f"peft:{ref / 'peft'}", f"nnx:{killed / 'nnx'}", env=env)
    assert first.returncode == second.returncode == -signal.SIGKILL, (first.stderr[-3000:], second.stderr[-3000:])
    assert third.returncode == 0, third.stderr[-3000:]

    for loop in ("peft", "nnx"):
        expected, got = log(ref / loop), log(killed / loop)
        assert [r["step"] for r in expected] == [1, 2, 3, 4, 5]
        assert [r["micro_batches"] for r in expected] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        # The first process logged steps 1 to 3, the restart resumed after the last checkpoint it left.
        assert [r["step"] for r in got] == [1, 2, 3, *range(RESTART[loop], 6)], loop
        resumed = got[:RESTART[loop] - 1] + got[3:]
        assert resumed == expected, loop  # losses bit-identical, each micro-batch once and in order
        a, b = np.load(ref / loop / "lora.npz"), np.load(killed / loop / "lora.npz")
        assert sorted(a) == sorted(b) and len(a) > 0
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{loop}: {name}")
