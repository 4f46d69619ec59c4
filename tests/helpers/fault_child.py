"""Writes a Tunix PeftTrainer checkpoint root with Tunix's own CheckpointManager (LoRA params and AdamW state),
through gemport's wrapper of it; run as a script, it can fill the disk at one step (tests/run/test_faults.py).

    python fault_child.py ROOT SAVED FAIL_AT KEEP
"""

import resource
import signal
import sys


def write_checkpoints(root, saved=3, fail_at=0, keep=0):
    """Save steps 1..saved into ``root`` (keeping ``keep``, 0 all); from step ``fail_at`` on every write past
    512 bytes fails, as on a full disk (EFBIG through RLIMIT_FSIZE, in this process only)."""
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.sft import checkpoint_manager

    from gemport.run.trainer import _Checkpoints

    class Model(nnx.Module):
        def __init__(self):
            self.w_lora_a = nnx.LoRAParam(jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64))
            self.w = nnx.Param(jnp.ones((4,)))

    model = Model()
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
    options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=keep or None)
    manager = _Checkpoints(checkpoint_manager.CheckpointManager(str(root), options), str(root))
    for step in range(1, saved + 1):
        if step == fail_at:
            manager._checkpoint_manager.wait_until_finished()
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.RLIM_INFINITY))
        manager.save(step, model, optimizer, save_only_lora_params=True, force=True)
    manager.close()


if __name__ == "__main__":
    write_checkpoints(sys.argv[1], *map(int, sys.argv[2:]))
