"""An attempt of a run over several clusters on one reached over SSH (its profile's ``login``
section): the run directory copied there with its newest complete checkpoint (checked against its
manifest there: launcher.runs.far_copy), then submitted by the lmlaunch on that login node as
``submit --resume`` would, on that cluster's profile (``login.profile``), under the runs root of
this profile (``runs_root``: a path there). The job id it gave is this run's next job; the
registry records where the copy is, so that `status`, `history`, `cancel` and the watcher reach it.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path, PurePosixPath
from typing import Any

from launcher.planning import transport
from launcher.runs import far_copy, shared_bucket
from launcher.spec.profiles import Profile
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.job.plan import LaunchPlan
from lmcore.run.checkpoint_index import choose_for_resume
from lmcore.slurm import client as slurm
from lmcore.slurm.commands_target import CommandsTarget

SUBMIT_TIMEOUT_S = 600.0  # the lmlaunch there plans and submits (imports, sbatch): a hang guard


def far_run(profile: Profile, plan: LaunchPlan) -> far_copy.FarRun:
    """Where the run's copy is on ``profile``'s cluster (its runs root asked there once)."""
    assert profile.login is not None
    login = transport.login_argv(profile)
    run_dir = PurePosixPath(plan.paths.run_dir)
    checkpoints = PurePosixPath(plan.paths.checkpoint_dir).relative_to(run_dir)  # inside: planning.clusters checked
    try:
        root = far_copy.resolve_root(login, profile.runs_root, profile.name)
    except far_copy.CopyFailed as exc:
        conn = transport.connection(profile)
        if conn.master_alive():
            raise
        raise UserError(f"{exc.message}\n(no ssh master connection to {profile.login.ssh} is open; where its login "
                        f"asks for a password or a second factor, open one with\n  {shlex.join(conn.open_command())}\n"
                        "then submit again)", exit_code=2) from None
    return far_copy.FarRun(profile.name, login, f"{root}/{run_dir.name}", profile.login.lmlaunch,
                           profile.login.profile or profile.name, str(checkpoints))


def submit_there(plan: LaunchPlan, far: far_copy.FarRun) -> str:
    """The run (its directory here, opened already) copied to ``far`` and submitted there; its job
    id (an earlier run's copy of its name there is set aside first). Nothing is queued when the
    copy fails its checks; its checkpoint is not copied when the run's bucket holds it. When the answer is lost after the lmlaunch
    there may have submitted (the connection dropped, no answer in time), the job it queued under
    the run's name is found and taken (never a second one)."""
    chosen = choose_for_resume(plan.paths.checkpoint_dir).chosen
    if chosen is not None and shared_bucket.holds_newest(Path(plan.paths.run_dir), plan, chosen.path.name).name:
        chosen = None  # in the run's bucket: the attempt there downloads it (lmtrain.checkpoint.store_mirror)
    far_copy.push(Path(plan.paths.run_dir), far, chosen.path if chosen else None)
    words = ("submit", f"{far.run_dir}/spec.yaml", "--resume", "--cluster", far.profile, "clusters=null", "move=null")
    started = time.time()
    try:
        answer = far.shell(f"cd {shlex.quote(far.run_dir)} && {far.lmlaunch_argv(*words)}", timeout=SUBMIT_TIMEOUT_S)
    except far_copy.CopyFailed as exc:  # no answer in time
        return _queued_anyway(plan, far, started, exc.message)
    job = re.search(r"^(?:resumed|submitted) run '[^']*': job (\d+)", answer.stdout, re.M)
    if job is not None:
        return job.group(1)
    said = (answer.stdout + answer.stderr).strip()
    if answer.returncode == slurm.SSH_FAILED:
        return _queued_anyway(plan, far, started, said[-600:] or "ssh failed")
    raise UserError(f"{far.cluster}: the lmlaunch on {far.where} did not submit the run "
                    f"(exit {answer.returncode}): {said[-1500:] or 'no output'}")


def _queued_anyway(plan: LaunchPlan, far: far_copy.FarRun, since: float, why: str) -> str:
    """The job the lmlaunch there queued for the run although its answer was lost; refused with
    ``why`` when it queued none."""
    try:
        with slurm.through_commands(CommandsTarget(profile=far.cluster, login=far.login)):
            found = slurm.jobs_submitted_since(plan.run_name, since)
    except (UserError, SlurmUnavailable) as exc:
        raise UserError(f"{far.cluster}: the answer of the lmlaunch there was lost ({why}), and whether it queued "
                        f"the run could not be asked ({exc.message}): `lmlaunch status {plan.run_name}` there says; "
                        "nothing was recorded here") from None
    if not found:
        raise UserError(f"{far.cluster}: the lmlaunch there did not answer ({why}) and queued nothing")
    return found[-1]


def over_ssh(target: Any, resolved: Any, after: list[Any]) -> bool:
    """Whether the run goes to a cluster reached over SSH (a run over several clusters only: one
    cluster over SSH is `lmlaunch --remote NAME submit`); --after is refused there (the lmlaunch
    there submits, and knows no job of this registry)."""
    if not transport.reached_over_ssh(target):
        return False
    if not resolved.spec.clusters:
        raise UserError(f"profile '{resolved.profile.name}' is reached over SSH (its login section): submit on it "
                        f"with `lmlaunch --remote {resolved.profile.name} submit ...`, or name it in clusters: [...] "
                        "beside a cluster reached from here", exit_code=2)
    if after:
        raise UserError(f"--after: cluster {resolved.profile.name} is reached over SSH, where the lmlaunch there "
                        "submits the run and no dependency on a job of this machine's registry can be carried; "
                        "submit it once the upstream run has ended, or on a cluster reached from here", exit_code=2)
    return True


def recorded(target: dict[str, Any] | None, far: far_copy.FarRun | None, notes: list[str]) -> dict[str, Any] | None:
    """The registry's way to the job's cluster, with where the copy is when it went over SSH (said in ``notes``)."""
    if far is None or target is None:
        return target
    notes.append(f"submitted there by its lmlaunch, on a copy of the run directory ({far.where}); the watcher beside "
                 "the run copies its files back")
    return {**target, "far": far.to_json()}


def bring_back(record: Any) -> None:
    """Before a resume here: the files and newest checkpoint of the copy over SSH the run's last job
    ran on, checked; refused when it cannot be reached (the resume would start from an older one)."""
    if (trouble := far_copy.refresh(record, checkpoint=True)) is not None:
        raise UserError(f"run '{record.name}' last ran on a cluster over SSH, and {trouble}: its newest checkpoint is "
                        "there; resume once it can be reached", exit_code=1)
