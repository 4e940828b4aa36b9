"""Test helper run as each local rank: the real lmtrain entry (real handlers, real agreement),
plus a callback that sends a real signal to this very process at a chosen optimizer step, so a
signal lands at a known step on a chosen rank.

usage: python _preempt_worker.py RUN_DIR [STEP:RANK:SIGNAL ...]   e.g. 7:1:USR2 12:0:TERM
"""

import os
import signal
import sys

import lightning.pytorch as pl

from lmtrain.entry import Hooks, run_task


def main() -> int:
    run_dir, plan = sys.argv[1], [a.split(":") for a in sys.argv[2:]]

    def setup(ctx):
        class SendSignal(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                for step, rank, name in plan:
                    if trainer.global_step == int(step) - 1 and trainer.global_rank == int(rank):
                        os.kill(os.getpid(), getattr(signal, "SIG" + name))

        return [SendSignal()]

    return run_task(run_dir, hooks=Hooks(setup=setup))


if __name__ == "__main__":
    sys.exit(main())
