"""``gemport sft`` in a process that SIGKILLs itself, for tests/test_sft_cli.py.

    python sft_child.py KILL_AFTER [gemport sft arguments]

Once the log entry of step KILL_AFTER is written and the checkpoint before it is complete, the process kills
itself with SIGKILL: no exit handler, no flush, no final checkpoint or adapter.
"""

import os
import signal
import sys

from gemport.cli import main
from gemport.train.outputs import HFOutputs

KILL_AFTER = int(sys.argv[1])
logged = HFOutputs.on_train_step_end


def on_train_step_end(self, trainer, train_step, train_loss):
    logged(self, trainer, train_step, train_loss)
    if train_step == KILL_AFTER:
        trainer.checkpoint_manager._checkpoint_manager.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)


HFOutputs.on_train_step_end = on_train_step_end
sys.exit(main(["sft", *sys.argv[2:]]))
