"""Test helper run as each local rank: the real lmtrain entry with every way of reading a
tensor's value on the host (``item``, ``tolist``, ``float``/``int``/``bool``, ``numpy``)
counted per optimizer step, with the file and function that asked.

On a GPU each such read waits for every kernel queued before it (a host sync); on this CPU
machine nothing waits, but the reads are the same, so counting them here shows which steps
would sync. Rank 0 writes ``RUN_DIR/host-reads.json``: {step: [[file, function], ...]}.

usage: python _count_host_reads.py RUN_DIR
"""

import json
import os
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from _extra_callbacks import run_task_with

READS: dict[int, list[tuple[str, str]]] = defaultdict(list)
STEP = [0]


def _counting(name: str):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        caller = traceback.extract_stack(limit=2)[0]  # who asked (the frame that called the read)
        READS[STEP[0]].append((caller.filename, caller.name))
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, read)


class StepCounter(pl.Callback):
    """Reads made during optimizer step S (its forward, backward, optimizer and the batch-end
    callbacks before this one) are filed under S; this callback runs last."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        STEP[0] = trainer.global_step + 1

    def on_train_end(self, trainer, pl_module):
        STEP[0] = -1


def main() -> int:
    run_dir = sys.argv[1]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        _counting(name)
    code = run_task_with(run_dir, lambda _: [StepCounter()])
    if os.environ.get("RANK") == "0":
        Path(run_dir, "host-reads.json").write_text(json.dumps({str(k): v for k, v in READS.items() if k > 0}))
    return code


if __name__ == "__main__":
    sys.exit(main())
