"""``eval.alongside`` -> the evaluator's plan (lmcore.run.eval_alongside.EvaluatorPlan): the second
component of the run's heterogeneous job and what it scores. Pure, as the planner is; the task
names are checked against the task files by :func:`task_problems` (it reads them)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from launcher.planning import eval_tasks
from lmcore.errors import did_you_mean
from lmcore.job.plan import RunPaths, SlurmParams
from lmcore.job.spec import JobSpec
from lmcore.run.eval_alongside import EVALUATOR_LOG, EvaluatorPlan

KEY = "eval.alongside"


def plan_evaluator(spec: JobSpec, profile: Any, slurm: SlurmParams, paths: RunPaths,
                   problems: list[str], python: str = "python") -> EvaluatorPlan | None:
    """The evaluator of a spec with ``eval.alongside`` (None without); what cannot work is added to
    ``problems`` (each naming its key and what is allowed)."""
    ev = spec.eval.alongside if spec.eval is not None else None
    if ev is None:
        return None
    partition = ev.partition or slurm.partition
    if partition not in profile.partitions:
        problems.append(f"{KEY}.partition '{partition}' is not a partition of profile '{profile.name}'"
                        f"{did_you_mean(partition, profile.partitions)}; allowed: {', '.join(profile.partitions)}")
    elif spec.resources.time_minutes > profile.partitions[partition].max_minutes:
        problems.append(f"{KEY}.partition '{partition}': its max_time({profile.partitions[partition].max_time}) is "
                        f"shorter than resources.time({spec.resources.time}), which the evaluator shares")
    gpus = ev.gpus_per_node if ev.gpus_per_node is not None else min(1, slurm.gpus_per_node)
    if gpus > profile.gpus_per_node:
        problems.append(f"{KEY}.gpus_per_node({gpus}) is more than a node of profile '{profile.name}' has "
                        f"(gpus_per_node: {profile.gpus_per_node})")
    n = ev.every_n_steps
    every = spec.checkpoint.every_n_steps
    if n is not None and n % every:
        problems.append(f"{KEY}.every_n_steps({n}) is not a multiple of checkpoint.every_n_steps({every}): only "
                        f"checkpoints can be scored (allowed: {every}, {2 * every}, {3 * every}, ...)")
    if spec.eval is not None and spec.eval.checkpoint is not None:  # the spec's own validator refuses it too
        problems.append(f"{KEY}: not with eval.checkpoint (a job that evaluates instead of training)")
    return EvaluatorPlan(
        partition=partition, nodes=ev.nodes, cpus_per_task=ev.cpus_per_task or slurm.cpus_per_task, gpus=gpus,
        gres=f"{profile.gres_name}:{gpus}" if gpus else None, mem=ev.mem, tasks=tuple(ev.tasks),
        task_dirs=tuple(ev.task_dirs), every_n_steps=n, behind=ev.behind, limit=ev.limit,
        batch_size=ev.batch_size, finish_wait_s=ev.finish_wait_s,
        log=str(PurePosixPath(paths.run_dir) / EVALUATOR_LOG), python=python,
    )


def task_problems(spec: JobSpec, python: str | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) of ``eval.alongside``'s task directories and names, read from the task
    files here (lm-eval's: where ``python``, the evaluator's interpreter, has it)."""
    ev = spec.eval.alongside if spec.eval is not None else None
    if ev is None:
        return [], []
    problems = [f"{KEY}.task_dirs[{i}]: {d} is not a directory" for i, d in enumerate(ev.task_dirs)
                if not Path(d).is_dir()]
    unknown, looked = eval_tasks.unknown_tasks(ev.tasks, ev.task_dirs, python)
    if unknown and looked:
        problems += [f"{KEY}.tasks: lm-eval knows no task '{t}' (not lm-eval's, not shipped: "
                     f"{', '.join(eval_tasks.SHIPPED_EVAL_TASKS)}, not in task_dirs)" for t in unknown]
        return problems, []
    if unknown:
        return problems, [f"{KEY}.tasks: lm-eval is not installed for {python or 'this interpreter'} (pip install "
                          f"'lmlaunch[eval]'; the profile's eval_python names the evaluator's environment), so "
                          f"{', '.join(unknown)} could not be checked; the evaluator fails on a name lm-eval does not know"]
    return problems, []
