"""The picklable callable that submitit runs in every SLURM task.

It is deliberately light (no torch at import): the login node pickles it at submit time.
On the allocation, submitit's runner (started by lmtrain.task.main, which owns the preemption
signals before it) unpickles it and calls it once per task; the heavy imports happen inside
``__call__``. There is deliberately no ``checkpoint`` method: lmtrain owns checkpoints and
requeue. The entry adopts the signal handlers task_main installed (``lmtrain.preemption.signals.own_signals``;
a run started by submitit's own runner gets them there, after submitit's).
"""

from __future__ import annotations


class TrainTask:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> int:
        from lmtrain.task.entry import run_slurm_task

        return run_slurm_task(self.run_dir)

    def __repr__(self) -> str:
        return f"TrainTask(run_dir={self.run_dir!r})"
