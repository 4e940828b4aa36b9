"""LaunchPlan -> submitit executor -> SLURM job. The only module that uses submitit.

``render_script`` is pure: ``--dry-run`` prints it, and the submission writes the very same
text (submitit renders both from the same parameters).
"""

from __future__ import annotations

import shlex
from typing import Any

from launcher.plan import LaunchPlan


def setup_lines(plan: LaunchPlan) -> list[str]:
    """Profile setup, then every planned variable exported with its value shell-quoted.

    MASTER_PORT is not set here: lmtrain's rank 0 picks a free port on its own node at every
    attempt (see ``plan.rendezvous``)."""
    lines = [
        f"# lmlaunch: run {plan.run_name}, profile {plan.profile}; "
        f"rerun this plan with: lmlaunch submit {plan.paths.spec_yaml} --dry-run"
    ]
    lines += list(plan.setup)
    for name in sorted(plan.env):
        lines.append(f"export {name}={shlex.quote(plan.env[name])}")
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


# --------------------------------------------------------------------------- submission


def _submit_with_submitit(plan: LaunchPlan, fn: Any = None) -> str:
    """sbatch the plan through submitit's SlurmExecutor; returns the job id.

    The callable (``fn``, tests pass a trivial one) defaults to
    ``lmtrain.task.TrainTask(run_dir)``, pickled by reference: the login node
    never imports torch, the task imports it when called on the allocation. The command srun
    starts is :func:`submit_command` and the script is exactly :func:`render_script`.
    """
    import contextlib
    import io

    from submitit.core.utils import FailedJobError
    from submitit.slurm.slurm import SlurmExecutor

    from launcher import slurm
    from launcher.errors import SlurmUnavailable, UserError
    from lmtrain.task import TrainTask

    class PlanExecutor(SlurmExecutor):
        @property
        def _submitit_command_str(self) -> str:
            return submit_command(plan)

    try:
        executor = PlanExecutor(folder=plan.paths.submitit_dir)
    except RuntimeError as exc:  # submitit: 'Could not detect "srun"'
        raise SlurmUnavailable(f"cannot submit: {exc} (no SLURM client on this machine)") from None
    executor.update_parameters(**executor_parameters(plan))
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            job = executor.submit(fn if fn is not None else TrainTask(plan.paths.run_dir))
    except FailedJobError as exc:
        msg = (str(exc) or captured.getvalue()).strip()
        if any(m in msg for m in slurm._DOWN_MARKERS):
            raise SlurmUnavailable(
                f"sbatch could not reach the SLURM controller: {msg.splitlines()[0]}. "
                "Local cluster: start it with `lmlaunch cluster up`."
            ) from None
        raise UserError(f"sbatch refused the job of run '{plan.run_name}': {msg}", exit_code=1) from None
    except FileNotFoundError as exc:
        raise SlurmUnavailable(f"cannot submit: {exc.filename or exc} not found (no SLURM client)") from None
    return str(job.job_id)


def submit_plan(
    resolved: Any,
    ctx: Any,
    *,
    new: bool = False,
    resume: bool = False,
    spec_path: str | None = None,
) -> int:
    """Create (or reuse with ``resume``, or archive and recreate with ``new``) the run directory,
    write spec/plan, submit, record the job id in the registry and print what to do next.

    Never mixes two runs: an existing run name needs ``--resume`` or ``--new``; neither is
    allowed while a job of that run is queued or running. When submission fails nothing is left
    behind: no registry entry, no half-written run directory.
    """
    import json
    import os
    import time
    from pathlib import Path

    from launcher import runs, slurm
    from launcher.errors import SlurmUnavailable, UserError

    plan: LaunchPlan = resolved.plan
    env = ctx.environ or None
    name = plan.run_name
    run_dir = Path(plan.paths.run_dir)
    rec = runs.load_record(name, env)
    exists = run_dir.exists() or rec is not None
    jobs_text = f", jobs {', '.join(rec.job_ids)}" if rec and rec.job_ids else ""
    if exists and not (new or resume):
        raise UserError(
            f"run '{name}' already exists ({run_dir}{jobs_text}). Continue it from its checkpoints with "
            f"--resume, start over with --new (the old run directory is kept as {name}.archived-<time>), "
            f"or give this run another name (override: name=<new name>)"
        )
    if resume and not run_dir.is_dir():
        raise UserError(f"--resume: there is no run directory {run_dir} for run '{name}' to resume; submit without --resume")

    if not slurm.ping():
        raise SlurmUnavailable(
            "the SLURM controller does not answer (`scontrol ping`); nothing was submitted. "
            "Local cluster: start it with `lmlaunch cluster up`."
        )
    if exists and rec and rec.job_ids:
        active = [j for j in slurm.squeue(rec.job_ids) if slurm.is_active(j.state)]
        if active:
            listed = ", ".join(f"{j.job_id} ({j.state})" for j in active)
            raise UserError(
                f"run '{name}' still has a job in SLURM: {listed}; wait for it to end or "
                f"`lmlaunch cancel {name}` before {'--resume' if resume else '--new'}"
            )

    undo: list[Any] = []
    notes: list[str] = []
    try:
        if new and run_dir.exists():
            archived = runs.archive_run_dir(run_dir)
            undo.append(lambda a=archived: os.rename(a, run_dir))
            notes.append(f"previous run archived to {archived}")
            if rec is not None:
                (archived / "registry.json").write_text(json.dumps(rec.to_dict(), indent=2, sort_keys=True) + "\n")
        if new and rec is not None:
            runs.delete_record(name, env)
            undo.append(lambda r=rec: runs.save_record(r, env))
            rec = None
        created = runs.prepare_run_dir(run_dir)
        if created:
            undo.append(lambda: runs.remove_tree(run_dir))
        else:
            backups = {}
            for p in (plan.paths.spec_yaml, plan.paths.plan_json, plan.paths.deepspeed_json):
                if p and Path(p).exists():
                    backups[p] = Path(p).read_bytes()
            submitit_dir = Path(plan.paths.submitit_dir)
            before = set(submitit_dir.iterdir())

            def restore(backups: dict[str, bytes] = backups, before: set[Path] = before) -> None:
                for path, data in backups.items():
                    Path(path).write_bytes(data)
                for extra in set(submitit_dir.iterdir()) - before:
                    extra.unlink(missing_ok=True)

            undo.append(restore)
            cancelled = run_dir / "CANCELLED"
            if cancelled.exists():
                data = cancelled.read_bytes()
                cancelled.unlink()
                undo.append(lambda d=data: cancelled.write_bytes(d))
                notes.append("the CANCELLED marker of the earlier job was removed: this run may be requeued again")
            if (run_dir / "DONE").exists():
                notes.append("this run already reached max_steps (DONE marker); raise trainer.max_steps to train further")
        runs.write_launch_files(plan)
        job_id = _submit_with_submitit(plan)
    except BaseException:
        for step in reversed(undo):
            try:
                step()
            except OSError:
                pass  # best effort: report the original error, not the cleanup's
        raise

    if rec is None:
        rec = runs.RunRecord(name=name, profile=plan.profile, run_dir=str(run_dir), spec_path=spec_path)
    rec.job_ids.append(job_id)
    rec.submitted_at.append(time.time())
    rec.state = "submitted"
    rec.run_dir = str(run_dir)
    rec.profile = plan.profile
    if spec_path:
        rec.spec_path = str(Path(spec_path).absolute())
    rec.max_steps = plan.trainer.get("max_steps")
    runs.save_record(rec, env)

    t = plan.topology
    s = plan.slurm
    verb = "resumed" if resume else "submitted"
    ctx.out(
        f"{verb} run '{name}': job {job_id} on partition {s.partition}, "
        f"nodes({t.nodes}) x tasks_per_node({t.tasks_per_node}) = world_size({t.world_size})"
    )
    for note in notes:
        ctx.out(f"note: {note}")
    ctx.out(f"run directory: {run_dir}")
    ctx.out("next:")
    ctx.out(f"  lmlaunch status {name}")
    ctx.out(f"  lmlaunch logs {name}")
    ctx.out(f"  lmlaunch cancel {name}")
    return 0
