"""A sweep as one SLURM array (launcher.search.sweep plans the points): the array's setup, parameters and
script, and its submission through launcher.submit.submission's submitit path. Every point has the first
point's shape (launcher.search.sweep.shape); what differs per point is chosen in the batch script by
SLURM_ARRAY_TASK_ID: the run directory, the code snapshot on PYTHONPATH, and every planned
variable whose value holds the run directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from launcher.submit.in_place import restart_loop_head
from launcher.submit.shell import export_line, shell_quote
from launcher.submit.submission import container_lines, executor_parameters, run_submitit, submit_command
from lmcore.plan import LaunchPlan
from lmcore.rundir import RunLayout


def _per_point_export(name: str, value: str, run_dir: str) -> str:
    """``export NAME=...`` with the first point's run directory in ``value`` made this task's."""
    parts = [shell_quote(p) if p else "" for p in value.split(run_dir)]
    return f"export {name}=" + '"$LMLAUNCH_RUN_DIR"'.join(parts)


def array_setup(plan: LaunchPlan, run_dirs: list[str]) -> list[str]:
    """A sweep array's setup: the shared environment (launcher.search.sweep.shape), then each task's run
    directory and code snapshot, picked by its SLURM_ARRAY_TASK_ID."""
    from launcher.search.sweep import PER_POINT_ENV

    run_dir = plan.paths.run_dir
    lines = [f"# lmlaunch: sweep array of {len(run_dirs)} points, profile {plan.profile}; "
             "each task runs the point its SLURM_ARRAY_TASK_ID names"]
    lines += list(plan.setup)
    own = sorted(n for n in plan.env if n not in PER_POINT_ENV and run_dir in plan.env[n])
    lines += [export_line(n, plan.env[n]) for n in sorted(plan.env) if n not in PER_POINT_ENV and n not in own]
    lines.append("LMLAUNCH_POINTS=(" + " ".join(shell_quote(d) for d in run_dirs) + ")")
    lines.append('export LMLAUNCH_RUN_DIR="${LMLAUNCH_POINTS[$SLURM_ARRAY_TASK_ID]}"')
    lines.append('export PYTHONPATH="$LMLAUNCH_RUN_DIR/code${PYTHONPATH:+:$PYTHONPATH}"')
    lines += [_per_point_export(n, plan.env[n], run_dir) for n in own]  # e.g. the NCCL flight recorder's file
    return lines + container_lines(plan) + restart_loop_head(plan)


def array_parameters(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                     dependency: str | None = None) -> dict[str, Any]:
    """submitit parameters of one sweep array (``plan``: its first point; every point has its shape)."""
    params = executor_parameters(plan, dependency)
    params["job_name"] = Path(sweep_dir).name
    params["setup"] = array_setup(plan, run_dirs)
    params["additional_parameters"] = {**params["additional_parameters"], "chdir": sweep_dir}
    params["array_parallelism"] = max_parallel
    return params


def _array_plan(plan: LaunchPlan, sweep_dir: str) -> LaunchPlan:
    """The first point's plan as the whole array's: a container starts in the sweep directory, as
    the array's tasks do on the host (sbatch --chdir), not in the first point's run directory."""
    box = plan.container
    if box is None or box["workdir"] != plan.paths.run_dir:
        return plan
    old = f"--container-workdir={plan.paths.run_dir}"
    swapped = {**box, "workdir": sweep_dir,
               "srun_args": [f"--container-workdir={sweep_dir}" if a == old else a for a in box["srun_args"]],
               "prefix": [{f"--workdir={plan.paths.run_dir}": f"--workdir={sweep_dir}"}.get(a, a) for a in box["prefix"]]}
    if box["runtime"] == "apptainer":
        i = swapped["prefix"].index("--pwd")
        swapped["prefix"][i + 1] = sweep_dir
    return dataclasses.replace(plan, container=swapped,
                               srun_args=tuple(f"--container-workdir={sweep_dir}" if a == old else a
                                               for a in plan.srun_args))


def render_array_script(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                        dependency: str | None = None) -> str:
    """A sweep array's sbatch script exactly as submit_array writes it."""
    from submitit.slurm.slurm import _make_sbatch_string

    plan = _array_plan(plan, sweep_dir)
    params = array_parameters(plan, run_dirs, sweep_dir, max_parallel, dependency)
    folder = str(RunLayout.of(sweep_dir).submitit)
    return _make_sbatch_string(command=submit_command(plan, folder), folder=folder, map_count=len(run_dirs), **params)


def submit_array(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                 dependency: str | None = None) -> list[str]:
    """sbatch one array whose task i runs the point in ``run_dirs[i]``; its tasks' job ids (A_i)."""
    from lmtrain.task.train_task import TrainTask

    plan = _array_plan(plan, sweep_dir)
    params = array_parameters(plan, run_dirs, sweep_dir, max_parallel, dependency)
    return run_submitit(plan, params, [TrainTask(d) for d in run_dirs], str(RunLayout.of(sweep_dir).submitit))


