"""Test helper run as each local rank: the real lmtrain entry with every way of reading a
tensor's value on the host (``item``, ``tolist``, ``float``/``int``/``bool``, ``numpy``, and an
operator's own read inside C++: :class:`ScalarReads`) counted per optimizer step, with the file and
function that asked.

On a GPU each such read waits for every kernel queued before it (a host sync); on this CPU
machine nothing waits, but the reads are the same, so counting them here shows which steps
would sync. DeepSpeed's accelerator synchronize is counted too. Rank 0 writes
``RUN_DIR/host-reads.json``: {step: [[file, function], ...]}, and ``RUN_DIR/wrapping.json``: the
strategy's class and the class of what it wraps the module in.

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
from torch.utils._python_dispatch import TorchDispatchMode

READS: dict[int, list[tuple[str, str]]] = defaultdict(list)
STEP = [0]
WRAPPING: dict[str, str | bool | None] = {}  # the strategy, what it wraps the module in, whether the group parted


def _counting(name: str):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        caller = traceback.extract_stack(limit=2)[0]  # who asked (the frame that called the read)
        READS[STEP[0]].append((caller.filename, caller.name))
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, read)


class ScalarReads(TorchDispatchMode):
    """Reads made inside operators, where no Python method is called (an op's C++ reading a
    tensor's value: ``aten::_local_scalar_dense``), filed under the innermost Python frame outside
    torch; a Python-level read, counted by ``_counting`` already, is not counted again."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()[:-1]
            if not any(f.name == "read" and f.filename == __file__ for f in stack):
                frame = next((f for f in reversed(stack) if "/torch/" not in f.filename and f.filename != __file__), None)
                READS[STEP[0]].append((frame.filename, frame.name) if frame else ("torch", "?"))
        return func(*args, **(kwargs or {}))


def _count_accelerator_syncs() -> None:
    """DeepSpeed's accelerator synchronize (its throughput timers call it twice a micro step when
    they are on): a no-op on this CPU, a device sync on a GPU. Counted under ("accelerator",
    "synchronize") whoever calls it."""
    if "deepspeed" not in sys.modules:
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    original = accelerator.synchronize

    def synchronize(*args, **kwargs):
        READS[STEP[0]].append(("accelerator", "synchronize"))
        return original(*args, **kwargs)

    accelerator.synchronize = synchronize


class StepCounter(pl.Callback):
    """Reads made during optimizer step S (its forward, backward, optimizer and the batch-end
    callbacks before this one) are filed under S; this callback runs last."""

    def on_fit_start(self, trainer, pl_module):
        _count_accelerator_syncs()  # DeepSpeed is imported by now (its strategy's)
        model = trainer.strategy.model
        WRAPPING.update(strategy=type(trainer.strategy).__name__, model=type(model).__name__ if model else None)

    def on_train_start(self, trainer, pl_module):
        self.mode = ScalarReads()
        self.mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        STEP[0] = trainer.global_step + 1

    def on_train_end(self, trainer, pl_module):
        STEP[0] = -1
        self.mode.__exit__(None, None, None)


def main() -> int:
    run_dir = sys.argv[1]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "cpu"):
        _counting(name)
    code = run_task_with(run_dir, lambda _: [StepCounter()])
    import torch.distributed as dist

    WRAPPING["group_left"] = not dist.is_initialized()  # lmtrain.distributed.task_env.leave_process_group, before exit
    if os.environ.get("RANK") == "0":
        Path(run_dir, "host-reads.json").write_text(json.dumps({str(k): v for k, v in READS.items() if k > 0}))
        Path(run_dir, "wrapping.json").write_text(json.dumps(WRAPPING))
    return code


if __name__ == "__main__":
    sys.exit(main())
