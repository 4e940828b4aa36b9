"""Test helper run as each local rank: the real lmtrain entry (real handlers, real agreement),
plus a callback that sends a real signal to this very process at a chosen optimizer step, so a
signal lands at a known step on a chosen rank.

usage: python _preempt_worker.py RUN_DIR [STEP:RANK:SIGNAL ...] [sleep:FROM_STEP:SECONDS]
e.g. ``7:1:USR2 12:0:TERM``; ``sleep:15:0.3`` slows every step from step 15 on (wall time only,
the numbers are unchanged) so that a test can signal the processes from outside in time.
"""

import os
import signal
import sys
import time

import lightning.pytorch as pl
from _extra_callbacks import run_task_with


def main() -> int:
    run_dir, plan = sys.argv[1], [a.split(":") for a in sys.argv[2:] if not a.startswith("sleep:")]
    slow = [a.split(":")[1:] for a in sys.argv[2:] if a.startswith("sleep:")]

    def setup(ctx):
        class SendSignal(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                for step, rank, name in plan:
                    if trainer.global_step == int(step) - 1 and trainer.global_rank == int(rank):
                        os.kill(os.getpid(), getattr(signal, "SIG" + name))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                for from_step, seconds in slow:
                    if trainer.global_step >= int(from_step):
                        time.sleep(float(seconds))

        return [SendSignal()]

    return run_task_with(run_dir, setup)


if __name__ == "__main__":
    sys.exit(main())
