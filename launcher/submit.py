"""LaunchPlan -> submitit executor -> SLURM job. The only module that uses submitit.

``render_script`` is pure: ``--dry-run`` prints it, and the submission writes the very same
text (submitit renders both from the same parameters).
"""

from __future__ import annotations

import shlex
from typing import Any

from launcher.plan import LaunchPlan


def setup_lines(plan: LaunchPlan) -> list[str]:
    """Profile setup, every planned variable exported with its value shell-quoted, then a
    MASTER_PORT chosen on this (the batch) host at every start of the script."""
    lines = [
        f"# lmlaunch: run {plan.run_name}, profile {plan.profile}; "
        f"rerun this plan with: lmlaunch submit {plan.paths.spec_yaml} --dry-run"
    ]
    lines += list(plan.setup)
    for name in sorted(plan.env):
        lines.append(f"export {name}={shlex.quote(plan.env[name])}")
    port_cmd = plan.rendezvous.get("master_port_command")
    if port_cmd:
        lines.append(f'export MASTER_PORT="$({port_cmd})"')
    return lines


def executor_parameters(plan: LaunchPlan) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (the keys of ``_make_sbatch_string``)."""
    s = plan.slurm
    extra: dict[str, Any] = {
        "requeue": True,
        "signal": s.signal,  # no "B:": the warning goes to every task of every step
    }
    if s.gres:
        extra["gres"] = s.gres
    params: dict[str, Any] = {
        "job_name": s.job_name,
        "partition": s.partition,
        "time": s.time_minutes,
        "nodes": s.nodes,
        "ntasks_per_node": s.ntasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "signal_delay_s": s.warning_seconds,
        "setup": setup_lines(plan),
        "additional_parameters": extra,
        "stderr_to_stdout": False,
        "use_srun": True,
        "wckey": None,  # no accounting wckey (submitit would add "submitit")
    }
    for key in ("mem", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    if s.exclusive:
        params["exclusive"] = True
    if plan.srun_args:
        params["srun_args"] = list(plan.srun_args)
    return params


def submit_command(plan: LaunchPlan) -> str:
    """What srun starts in every task: submitit's runner, which calls lmtrain.task.TrainTask."""
    return " ".join(
        shlex.quote(x)
        for x in [*shlex.split(plan.python), "-u", "-m", "submitit.core._submit", plan.paths.submitit_dir]
    )


def render_script(plan: LaunchPlan) -> str:
    """The sbatch script exactly as submit writes it."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(
        command=submit_command(plan), folder=plan.paths.submitit_dir, **executor_parameters(plan)
    )
