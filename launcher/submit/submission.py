"""LaunchPlan -> submitit executor -> SLURM job. The only module that submits through submitit.

The batch job is rendered before anything is submitted, by launcher.submit.script (the one
renderer; the dry run prints the same text); a job's submission hands it to submitit's executor
(``_make_submission_file_text``), which writes its text, and the way SLURM is reached submits it
(sbatch on the file, or its options as slurmrestd's fields). An array's job is rendered by
launcher.submit.script from the array executor's parameters, and equals
launcher.submit.script.render_array_script's (tests/integration/test_sweep.py compares
the file sbatch received with the dry run's).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from launcher.planning import transport
from launcher.runs import registry as runs
from launcher.runs.run_lock import run_lock
from launcher.submit import dependencies, far_submit, lifecycle, shape_check
from launcher.submit.script import executor_parameters, render_job, sbatch_script, submit_command
from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.job.plan import LaunchPlan
from lmcore.run import rundir
from lmcore.slurm import client as slurm, way as slurm_way
from lmcore.slurm.batch_job import BatchJob

# --------------------------------------------------------------------------- submission


def _submit_with_submitit(plan: LaunchPlan, fn: Any = None, dependency: str | None = None) -> str:
    """sbatch the plan through submitit's SlurmExecutor; returns the job id.

    The callable (``fn``, tests pass a trivial one) defaults to
    ``lmtrain.task.train_task.TrainTask(run_dir)``, pickled by reference: the login node
    never imports torch, the task imports it when called on the allocation. The command srun
    starts is launcher.submit.script.submit_command and the script is exactly its render_script,
    rendered here before submitit is asked.
    """
    from lmtrain.task.train_task import TrainTask

    params = executor_parameters(plan, dependency)
    job = render_job(plan, dependency)
    shape_check.judge(plan, job)  # a shape no node or partition of the cluster can hold is refused, nothing queued
    return run_submitit(plan, params, [fn if fn is not None else TrainTask(plan.paths.run_dir)],
                         plan.paths.submitit_dir, job=job)[0]


def run_submitit(plan: LaunchPlan, params: dict[str, Any], fns: list[Any], folder_name: str,
                 job: BatchJob | None = None) -> list[str]:
    """Submit ``fns`` (one: a job; several: an array) with submitit; their job ids. ``job``: a single
    job as launcher.submit.script rendered it, which sbatch receives as it is (an array is rendered
    there too, from the executor's parameters)."""
    import contextlib
    import io
    import subprocess
    import time

    from submitit.core.utils import FailedJobError

    sbatch_timeout = sbatch_timeout_s()
    PlanExecutor = _plan_executor(plan, folder_name, job if len(fns) == 1 else None, sbatch_timeout)
    try:
        executor = PlanExecutor(folder=folder_name)
    except RuntimeError as exc:  # submitit: 'Could not detect "srun"'
        raise SlurmUnavailable(f"cannot submit: {exc} (no SLURM client on this machine)") from None
    executor.update_parameters(**params)
    captured = io.StringIO()
    folder = Path(folder_name)
    before = set(folder.iterdir()) if folder.is_dir() else set()
    started = time.time()
    try:
        with contextlib.redirect_stderr(captured):
            if len(fns) == 1:
                jobs = [executor.submit(fns[0])]
            else:
                with executor.batch():
                    pending = [executor.submit(f) for f in fns]
                jobs = pending
    except FailedJobError as exc:
        msg = (str(exc) or captured.getvalue()).strip()
        cause = exc.__cause__
        if isinstance(cause, subprocess.CalledProcessError) and cause.returncode in (124, 137) and len(fns) == 1:
            return [_reconcile_timed_out_sbatch(plan, folder, before, started, sbatch_timeout)]
        if slurm.says_controller_down(msg):
            raise SlurmUnavailable(
                f"sbatch could not reach the SLURM controller: {msg.splitlines()[0]}. "
                "Local cluster: start it with `lmlaunch cluster up`."
            ) from None
        raise UserError(f"sbatch refused the job of run '{plan.run_name}': {msg}{shape_check.keys_of(msg)}",
                        exit_code=ExitCode.REFUSED) from None
    except FileNotFoundError as exc:
        raise SlurmUnavailable(f"cannot submit: {exc.filename or exc} not found (no SLURM client)") from None
    return [str(job.job_id) for job in jobs]


def _plan_executor(plan: LaunchPlan, folder_name: str, job: BatchJob | None, sbatch_timeout: int) -> Any:
    """submitit's SlurmExecutor for ``plan``: its srun command, ``job`` as the script of a single job
    (rendered before submission), an array's script rendered by launcher.submit.script from the
    executor's parameters, and the submission command this module chooses, given the rendered job."""
    from submitit.slurm.slurm import SlurmExecutor

    class PlanExecutor(SlurmExecutor):
        rendered: BatchJob | None = None  # the job whose script submitit has just written

        @classmethod
        def affinity(cls) -> int:
            # submitit refuses to start without srun on PATH; through slurmrestd none is needed
            # here, and a profile's own commands (submit.slurm_bin) need not be on PATH
            if slurm_way.way().needs_no_srun_here():
                return 2
            return super().affinity()

        @property
        def _submitit_command_str(self) -> str:
            return submit_command(plan, folder_name)

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            # rendered before submission (what the dry run prints), or an array's from its parameters
            self.rendered = job if job is not None else sbatch_script(command, str(self.folder), **self.parameters)
            return self.rendered.text

        def _make_submission_command(self, submission_file_path: Any) -> list[str]:
            # submitit reads the job id from the line sbatch prints; a controller that accepted the
            # job but answered late is then found by name and submit time (below)
            assert self.rendered is not None, "submitit wrote no script before submitting it"
            return slurm_way.way().submission_command(self.rendered, str(submission_file_path),
                                                      client_timeout_s=sbatch_timeout)

        def _internal_process_submissions(self, delayed: list[Any]) -> list[Any]:
            if len(delayed) < 2:
                return super()._internal_process_submissions(delayed)
            # submitit submits an array through a plain SlurmExecutor it makes by this module-level
            # name: it is made ours for the call, so the array's script is rendered here and
            # submitted as a single job is.
            import submitit.slurm.slurm as submitit_slurm

            plain, submitit_slurm.SlurmExecutor = submitit_slurm.SlurmExecutor, type(self)  # type: ignore[misc]
            try:
                return super()._internal_process_submissions(delayed)
            finally:
                submitit_slurm.SlurmExecutor = plain  # type: ignore[misc]

    return PlanExecutor


def submit_script(job: BatchJob, path: Path, *, dependency: str | None = None) -> str:
    """Submit a job launcher.submit.script rendered that runs no submitit job (``data prepare
    --on-cluster``'s array and final step, ``lmlaunch eval``'s job: their tasks run a module, not a
    pickled callable): its script written to ``path``, submitted under the same client-side limit as
    a run's; its job id. sbatch's refusal is a UserError in its own words, an unreachable controller
    SlurmUnavailable."""
    path.write_text(job.text)
    return slurm.sbatch_job(job, str(path), *([f"--dependency={dependency}"] if dependency else []),
                            timeout=sbatch_timeout_s())


SBATCH_TIMEOUT_VAR = "LMLAUNCH_SBATCH_TIMEOUT_S"
# Below submitit's 60 s: a task that starts while submit still waits for sbatch waits up to 60 s
# for its pickle, which the reconciliation names after the job id.
DEFAULT_SBATCH_TIMEOUT_S = 30
RECONCILE_WAIT_S = 60.0  # how long to wait for the controller to answer before giving up


def sbatch_timeout_s() -> int:
    """Seconds `sbatch` may take before submit stops waiting and reconciles (env LMLAUNCH_SBATCH_TIMEOUT_S)."""
    import os

    text = os.environ.get(SBATCH_TIMEOUT_VAR, str(DEFAULT_SBATCH_TIMEOUT_S))
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"{SBATCH_TIMEOUT_VAR}={text!r}: expected a whole number of seconds >= 1")
    return int(text)


def _reconcile_timed_out_sbatch(plan: LaunchPlan, folder: Any, before: set[Any], started: float, limit: int) -> str:
    """`sbatch` did not answer within ``limit`` s: the controller may or may not have queued the
    job. Ask it (by run name and submit time) instead of submitting a second time; when the job
    is there, finish what submitit would have done (name the script and the pickle after the job
    id; the task waits up to 60 s for its pickle). Raises SlurmUnavailable when it cannot tell."""
    import time

    deadline = time.monotonic() + RECONCILE_WAIT_S
    ids: list[str] = []
    while True:
        try:
            ids = slurm.jobs_submitted_since(plan.slurm.job_name, started, timeout=10)
            break
        except SlurmUnavailable:
            if time.monotonic() > deadline:
                raise SlurmUnavailable(
                    f"sbatch did not answer within {limit} s and the controller still does not answer: "
                    f"it is unknown whether run '{plan.run_name}' was queued. Check `squeue -n {plan.run_name}` "
                    "before submitting again (`lmlaunch submit ... --resume` refuses while a job of the run is queued)."
                ) from None
            time.sleep(2.0)
    if not ids:
        raise SlurmUnavailable(
            f"sbatch did not answer within {limit} s and the controller has no job '{plan.run_name}' submitted "
            "since then: nothing was queued; submit again"
        )
    job_id = ids[-1]
    new = [p for p in Path(folder).iterdir() if p not in before]
    hexname = re.compile(r"^[0-9a-f]{32}\.pkl$")
    pickles = [p for p in new if hexname.match(p.name)]
    scripts = [p for p in new if p.name.startswith(".submission_file_") and p.name.endswith(".sh")]
    if len(pickles) != 1 or len(scripts) != 1:
        raise SlurmUnavailable(
            f"sbatch timed out but job {job_id} of run '{plan.run_name}' was queued; its submitit files are "
            f"ambiguous ({[p.name for p in new]}): cancel it with `scancel {job_id}` and submit again"
        )
    pickles[0].rename(Path(folder) / f"{job_id}_submitted.pkl")
    target = Path(folder) / f"{job_id}_submission.sh"
    scripts[0].rename(target)
    scripts[0].symlink_to(target)  # as submitit keeps it
    return job_id


def refuse_clashes(plan: LaunchPlan, record: Any, resume: bool, env: Any, *, ask_slurm: bool = True) -> None:
    """A dry run's checks of what the submission would clash with: a checkpoint.dir another run
    writes; with ``ask_slurm``, where the controller answers, a job the run still has in SLURM."""
    _refuse_shared_checkpoint_dir(plan, env)
    if ask_slurm and record is not None and record.job_ids and slurm.ping(timeout=5.0):
        _refuse_active_job(record, plan, resume, env)


def _refuse_shared_checkpoint_dir(plan: LaunchPlan, env: Any) -> None:
    """Two runs must never write into one checkpoint directory (each would resume from, and
    prune, the other's checkpoints). Only a checkpoint.dir outside the run directory can clash."""
    import json
    import os

    mine = os.path.realpath(plan.paths.checkpoint_dir)
    if mine.startswith(os.path.realpath(plan.paths.run_dir) + os.sep):
        return
    for rec in runs.list_records(env):
        if rec.name == plan.run_name:
            continue
        try:
            other = json.loads(rundir.RunLayout.of(rec.run_dir).plan.read_text())["paths"]["checkpoint_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an archived or removed run directory holds no checkpoints of a live run
        if os.path.realpath(other) == mine:
            raise UserError(
                f"checkpoint.dir {plan.paths.checkpoint_dir} is already the checkpoint directory of run "
                f"'{rec.name}' ({rec.run_dir}); two runs must not share one (each would resume from and prune "
                f"the other's checkpoints). Give this run its own checkpoint.dir, or leave it unset "
                f"(<run dir>/checkpoints)"
            )


def submit_plan(
    resolved: Any,
    ctx: Any,
    *,
    new: bool = False,
    resume: bool = False,
    new_code: bool = False,
    spec_path: str | None = None,
    after: list[Any] | None = None,
) -> int:
    """Create (or reuse with ``resume``, or archive and recreate with ``new``) the run directory,
    write spec/plan, submit, record the job id in the registry and print what to do next.

    Never mixes two runs: an existing run name needs ``--resume`` or ``--new``; neither is
    allowed while a job of that run is queued or running. When submission fails nothing is left
    behind: no registry entry, no half-written run directory. Through the profile's slurmrestd
    when it says so (submit.via: rest; launcher.planning.transport).
    """
    with run_lock(resolved.plan.run_name, ctx.environ or None), \
            transport.through(transport.profile_target(resolved.profile), exactly=True):
        return _submit_plan(resolved, ctx, new=new, resume=resume, new_code=new_code, spec_path=spec_path, after=after)


def _submit_plan(resolved: Any, ctx: Any, *, new: bool, resume: bool, new_code: bool, spec_path: str | None,
                 after: list[Any] | None) -> int:
    plan, env, name = resolved.plan, ctx.environ or None, resolved.plan.run_name
    record = runs.load_record(name, env)
    if resume and record is not None:
        far_submit.bring_back(record)  # a copy over SSH its last job ran on: its newest checkpoint
    opening = lifecycle.plan_opening(plan, new=new, resume=resume, record=record, new_code=new_code)
    _refuse_shared_checkpoint_dir(plan, env)
    if not slurm.ping():
        raise SlurmUnavailable(
            "the SLURM controller does not answer (`scontrol ping`); nothing was submitted. "
            "Local cluster: start it with `lmlaunch cluster up`."
        )
    _refuse_active_job(opening.record, plan, resume, env)
    _refuse_dependency_elsewhere(after or [], resolved, env)
    dependency, after_notes = dependencies.dependency(after or [])  # before anything changes
    way = slurm_way.way()  # what it cannot carry is refused before anything changes
    way.check_carries(lambda: render_job(plan, dependency), f"run '{name}'")
    target = transport.profile_target(resolved.profile)
    far = far_submit.far_run(resolved.profile, plan) if far_submit.over_ssh(target, resolved, after or []) else None
    opening.apply(env)
    try:
        if far is not None:  # its lmlaunch submits a copy of the run directory there
            job_id = far_submit.submit_there(plan, far)
        else:
            job_id = _submit_with_submitit(plan, dependency=dependency)
    except BaseException:
        opening.rollback()
        raise
    waits = (dependency or "").replace(",", ":").split(":")
    notes = [*opening.notes, *after_notes, *(f"starts after {a.label()}" for a in after or [] if a.job_id in waits)]
    notes += [way.submitted_note] if way.submitted_note else []
    recorded = far_submit.recorded(transport.recorded(resolved.profile).get(plan.profile), far, notes)
    _record_submission(opening.record, plan, job_id, spec_path, after or [], env, recorded)
    _say_submitted(ctx, plan, job_id, notes, resumed=resume)
    return 0


def _refuse_dependency_elsewhere(after: list[Any], resolved: Any, environ: Any) -> None:
    """``--after RUN``: SLURM's dependency names a job of the cluster the run is submitted to; an
    upstream run whose job went to another cluster (runs over several clusters) is refused by name."""
    here = repr(transport.profile_target(resolved.profile))
    for a in after:
        up = runs.load_record(a.run, environ) if a.kind != dependencies.SINGLETON else None
        if up is not None and repr(transport.job_target(up, a.job_id, environ)) != here:
            raise UserError(f"--after {a.run}: its job {a.job_id} went to cluster '{up.profile_of(a.job_id)}', this run "
                            f"to '{resolved.profile.name}': a SLURM dependency names a job of the same cluster. Submit "
                            f"it with --cluster {up.profile_of(a.job_id)}, or once {a.run} has ended", exit_code=2)


def _refuse_active_job(rec: Any, plan: LaunchPlan, resume: bool, environ: Any = None) -> None:
    """A run with a job still queued or running in SLURM is neither resumed nor started anew: each
    of its jobs asked on the cluster it was submitted to (a run over several clusters)."""
    if not (rec and rec.job_ids):
        return
    name = plan.run_name
    several = len(rec.jobs_by_profile()) > 1 or rec.profile_of(rec.job_ids[-1]) != plan.profile
    active = [dataclasses.replace(j, job_id=f"{j.job_id} on {prof}") if several else j
              for prof, j in transport.active_jobs_of(rec, environ)]
    if active:
        listed = ", ".join(f"{j.job_id} ({j.state})" for j in active)
        raise UserError(
            f"run '{name}' still has a job in SLURM: {listed}; wait for it to end or "
            f"`lmlaunch cancel {name}` before {'--resume' if resume else '--new'}"
        )


def _record_submission(rec: Any, plan: LaunchPlan, job_id: str, spec_path: str | None, after: list[Any],
                       env: Any, target: dict[str, Any] | None = None) -> None:
    """The registry's record of the run, with this submission's job id, time and cluster (its
    profile, and its way to SLURM when it is a cluster of its own: ``target``)."""
    import time

    run_dir = str(Path(plan.paths.run_dir))
    if rec is None:
        rec = runs.RunRecord(name=plan.run_name, profile=plan.profile, run_dir=run_dir, spec_path=spec_path)
    rec.job_profiles = [rec.profile_of(j) if i >= len(rec.job_profiles) else rec.job_profiles[i]
                        for i, j in enumerate(rec.job_ids)] + [plan.profile]
    rec.job_ids.append(job_id)
    if target is not None:
        rec.targets[plan.profile] = target
    else:
        rec.targets.pop(plan.profile, None)
    rec.submitted_at.append(time.time())
    rec.state = "submitted"
    rec.run_dir = run_dir
    rec.profile = plan.profile
    if spec_path:
        rec.spec_path = str(Path(spec_path).absolute())
    rec.max_steps = plan.trainer.max_steps
    rec.after = [a.label() for a in after]
    runs.save_record(rec, env)


def _say_submitted(ctx: Any, plan: LaunchPlan, job_id: str, notes: list[str], *, resumed: bool) -> None:
    t, s, name = plan.topology, plan.slurm, plan.run_name
    ctx.out(
        f"{'resumed' if resumed else 'submitted'} run '{name}': job {job_id} on partition {s.partition}, "
        f"nodes({t.nodes}) x tasks_per_node({t.tasks_per_node}) = world_size({t.world_size})"
        + (f" = {t.parallelism.mesh()}" if (t.parallelism.tensor, t.parallelism.pipeline) != (1, 1) else "")
    )
    for note in notes:
        ctx.out(f"note: {note}")
    ctx.out(f"run directory: {plan.paths.run_dir}")
    ctx.out("next:")
    ctx.out(f"  lmlaunch status {name}")
    ctx.out(f"  lmlaunch logs {name}")
    ctx.out(f"  lmlaunch cancel {name}")
