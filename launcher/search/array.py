"""A sweep as one SLURM array (launcher.search.sweep plans the points), submitted through
launcher.submit.submission's submitit path. Every point has the first point's shape
(launcher.search.sweep.shape); its script (launcher.submit.script.render_array_script, the one
renderer, which the dry run prints) picks what differs per point by SLURM_ARRAY_TASK_ID: the run directory, the code snapshot
on PYTHONPATH, and every planned variable whose value holds the run directory."""

from __future__ import annotations

from launcher.submit.script import array_parameters, array_plan
from launcher.submit.submission import run_submitit
from lmcore.job.plan import LaunchPlan
from lmcore.run.rundir import RunLayout


def submit_array(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                 dependency: str | None = None) -> list[str]:
    """sbatch one array whose task i runs the point in ``run_dirs[i]``; its tasks' job ids (A_i)."""
    from lmtrain.task.train_task import TrainTask

    plan = array_plan(plan, sweep_dir)
    params = array_parameters(plan, run_dirs, sweep_dir, max_parallel, dependency)
    return run_submitit(plan, params, [TrainTask(d) for d in run_dirs], str(RunLayout.of(sweep_dir).submitit))
