"""``gemport sft`` in a process that signals itself, for tests/cli/test_sft_cli.py and tests/helpers/multihost_child.py
(``gemport dpo`` for tests/run/test_dpo_run.py, when its arguments begin with ``dpo``).

    python sft_child.py SIGNAL:AFTER [gemport sft arguments]        SIGNAL = kill | term
    python sft_child.py SIGNAL:AFTER dpo [gemport dpo arguments]

Once the log entry of step AFTER is written, the process sends itself SIGKILL (``kill``, after the checkpoint
before it is complete: no exit handler, no flush, no final checkpoint or adapter) or SIGTERM (``term``, as a
spot VM is told it is reclaimed; ``gemport sft`` saves at the next step boundary and exits with 143).
"""

import os
import signal
import sys
import time

from gemport.run.outputs import HFOutputs


def signal_after(kind: str, after: int) -> None:
    """Make ``gemport sft`` send itself ``kind`` (kill / term) once step ``after`` is logged."""
    logged = HFOutputs.on_train_step_end

    def on_train_step_end(self, trainer, train_step, train_loss):
        logged(self, trainer, train_step, train_loss)
        if train_step != after:
            return
        if kind == "kill":
            trainer.checkpoint_manager._checkpoint_manager.wait_until_finished()
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # under jax.distributed: lets JAX's preemption service tell the other processes

    HFOutputs.on_train_step_end = on_train_step_end


if __name__ == "__main__":
    from gemport.cli import main

    kind, after = sys.argv[1].split(":")
    signal_after(kind, int(after))
    command = sys.argv[2:3] if sys.argv[2:3] == ["dpo"] else ["sft"]
    sys.exit(main([*command, *sys.argv[2 + (command == ["dpo"]):]]))
