"""Test helper run as each local rank: the real lmtrain entry, saving every parameter's gradient
of the first optimizer step (after DDP's all-reduce, before clipping) to OUT/rank-<R>.pt.

usage: python _dump_first_grads.py RUN_DIR OUT_DIR
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from _extra_callbacks import run_task_with


class DumpFirstGrads(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            torch.save(grads, self.out / f"rank-{trainer.global_rank}.pt")


def main() -> int:
    run_dir, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    return run_task_with(run_dir, lambda _: [DumpFirstGrads(out)])


if __name__ == "__main__":
    sys.exit(main())
