"""Rehearsing what a real cluster does to a running job, on a real SLURM (`lmlaunch preempt`; the
tests and the benches call it too): the warning signal or SIGTERM to every task, a real preemption
by an exclusive job on the high-priority partition, a node set DOWN and RESUMEd; then waiting for
SLURM's requeue (or the restart in place) and, asked to, starting the requeued job at once. Every
SLURM call goes through lmcore.slurm (its admin actions: lmcore.slurm.admin).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.spec.profiles import load_profile
from lmcore.errors import ExitCode, UserError
from lmcore.run import rundir
from lmcore.slurm import admin as rehearsal, client as slurm

MODES = ("signal", "term", "requeue", "node-failure")
ENDED = {"completed", "cancelled", "failed", "timeout"}


@dataclass(frozen=True)
class Victim:
    """The running job of a run, as the controller sees it now."""

    run: str
    run_dir: str
    profile: str
    job_id: str
    nodes: list[str]
    nodelist: str
    restarts: int
    signal: str  # the plan's warning signal name (USR2 ...)


def running_job(rec) -> Victim:
    """The run's newest job, which must be RUNNING; a UserError saying why not otherwise."""
    job_id = rec.last_job_id
    if job_id is None:
        raise UserError(f"run '{rec.name}' has no SLURM job (submit it with `lmlaunch submit`): nothing to preempt")
    info = slurm.show_job(job_id)
    if info is None:
        raise UserError(
            f"run '{rec.name}': job {job_id} is no longer known to the SLURM controller (it ended): nothing to preempt",
            exit_code=ExitCode.FAILURE,
        )
    state = info.get("JobState", "UNKNOWN")
    if state != "RUNNING":
        hint = " (wait until it starts: `lmlaunch status`)" if slurm.is_active(state) else ""
        raise UserError(
            f"run '{rec.name}': job {job_id} is {state}, not RUNNING: only a running job can be preempted{hint}",
            exit_code=ExitCode.FAILURE,
        )
    nodelist = info.get("NodeList", "")
    restarts = info.get("Restarts", "0")
    return Victim(
        run=rec.name,
        run_dir=rec.run_dir,
        profile=rec.profile,
        job_id=job_id,
        nodes=rehearsal.hostnames(nodelist),
        nodelist=nodelist,
        restarts=int(restarts) if restarts.isdigit() else 0,
        signal=_plan_signal(Path(rec.run_dir)),
    )


def _plan_signal(run_dir: Path) -> str:
    try:
        return str(json.loads(rundir.RunLayout.of(run_dir).plan.read_text())["slurm"]["signal_name"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{rundir.RunLayout.of(run_dir).plan}: cannot read the run's warning signal (slurm.signal_name): {exc}") from None


def wait_requeued(victim: Victim, *, timeout: float, poll: float = 0.25, since: float | None = None) -> dict:
    """Poll until SLURM requeued the job (its restart count grew), its ranks restarted in place
    (``since`` given: an end line of this job after then that says so; a job with spare nodes)
    or it ended otherwise."""
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while True:
        info = slurm.show_job(victim.job_id)
        if info is None:
            return {"requeued": False, "state": "UNKNOWN"}
        state = info.get("JobState", "UNKNOWN")
        restarts = info.get("Restarts", "0")
        if restarts.isdigit() and int(restarts) > victim.restarts:
            return {"requeued": True, "state": state, "restarts": int(restarts)}
        if since is not None and (end := _restart_in_place_since(victim, since)) is not None:
            return {"requeued": False, "restarted_in_place": True, "state": state, "attempt": end.get("attempt"),
                    "left_out": end.get("left_out") or []}
        if slurm.state_group(state) in ENDED:
            return {"requeued": False, "state": state}
        if time.monotonic() > deadline:
            raise UserError(
                f"job {victim.job_id} was not requeued within {timeout:.0f} s (still {state})", exit_code=ExitCode.FAILURE
            )
        time.sleep(poll)


def _restart_in_place_since(victim: Victim, since: float) -> dict | None:
    """The run's end line of this job, written after ``since``, that restarted its ranks in place."""
    from lmcore.jsonlines import read_jsonl

    ends = [e for e in read_jsonl(rundir.RunLayout.of(victim.run_dir).ledger) if e.get("event") == "end"
            and str(e.get("job_id")) == victim.job_id and float(e.get("time") or 0) >= since]
    return next((e for e in reversed(ends) if e.get("restart") == "in_place"), None)


def _ranks_nodes(victim: Victim) -> list[str]:
    """The nodes the job's ranks run on now (the run's last start line), within its allocation:
    all of them, but its idle spares (resources.spare_nodes)."""
    from lmcore.jsonlines import read_jsonl

    starts = [e for e in read_jsonl(rundir.RunLayout.of(victim.run_dir).ledger) if e.get("event") == "start"
              and str(e.get("job_id")) == victim.job_id]
    nodes = [str(n) for n in (starts[-1].get("nodes") or [])] if starts else []
    return [n for n in nodes if n in victim.nodes] or victim.nodes


def wait_off_nodes(job_id: str, nodes: list[str], *, timeout: float, poll: float = 0.25,
                   job_runs_on: bool = False) -> bool:
    """Wait until the job's tasks are gone: it is no longer RUNNING or COMPLETING (unless
    ``job_runs_on``: its ranks restarted in place elsewhere), and no slurmd of ``nodes`` that can
    be asked still runs its processes (rehearsal.steps_left: on a node failure SLURM requeues the
    job at once while the node's slurmd kills its run for seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = slurm.show_job(job_id)
        if (job_runs_on or info is None or info.get("JobState") not in ("RUNNING", "COMPLETING")) \
                and not rehearsal.steps_left(job_id, nodes):
            return True
        time.sleep(poll)
    return False


REQUEUE_SETTLE_S = 2.0  # slurmd refuses a job credential from the second its previous run was revoked


def start_when_pending(job_id: str, nodes: list[str] | None = None, *, timeout: float = 60.0,
                       poll: float = 0.25) -> bool:
    """Once the requeued job is PENDING again and its previous run is gone from ``nodes``, let
    it start now (not after BeginTime). Started earlier, SLURM kills it as "non-startable: Job
    credential revoked" and it ends FAILED."""
    deadline = time.monotonic() + timeout
    pending_since = None
    while time.monotonic() < deadline:
        info = slurm.show_job(job_id) or {}
        state = info.get("JobState", "UNKNOWN")
        if state == "PENDING" and pending_since is None:
            pending_since = time.monotonic()
        if (state == "PENDING" and pending_since is not None and time.monotonic() - pending_since >= REQUEUE_SETTLE_S
                and rehearsal.ready_to_start(job_id, nodes)):
            try:
                rehearsal.start_now(job_id)
            except UserError:
                time.sleep(poll)  # the controller may still be finishing the requeue
                continue
            return True
        if slurm.state_group(state) in ENDED:
            return False
        time.sleep(poll)  # still being killed (COMPLETING) or requeued: PENDING comes next
    return False


def preempt(victim: Victim, mode: str, *, node: str | None = None, partition: str | None = None,
            timeout: float = 180.0, start_now: bool = False, environ=None) -> dict:
    """Do it; return what was done (times are seconds since the epoch / durations in s)."""
    result: dict = {"run": victim.run, "job_id": victim.job_id, "mode": mode, "nodes": victim.nodes}
    t0 = time.time()
    result["signalled_at"] = t0
    if mode == "signal":
        rehearsal.signal_steps(victim.job_id, victim.signal)
        result["signal"] = victim.signal
        return result
    if mode == "term":
        rehearsal.signal_steps(victim.job_id, "TERM")
        result["signal"] = "TERM"
        return result
    if mode == "requeue":
        high = partition or _high_partition(victim.profile, environ)
        holder = rehearsal.submit_holder(
            name=f"preempt-{victim.run}"[:120], partition=high, nodelist=victim.nodelist,
            num_nodes=len(victim.nodes) or 1, seconds=int(timeout) + 60,
        )
        result.update(preemptor_job_id=holder, partition=high)
        try:
            result.update(wait_requeued(victim, timeout=timeout))
        finally:
            slurm.cancel([holder])
    elif mode == "node-failure":
        ranks_on = _ranks_nodes(victim)
        down = node or (ranks_on[-1] if ranks_on else None)
        if down is None or down not in victim.nodes:
            raise UserError(f"--node {down}: job {victim.job_id} runs on {', '.join(victim.nodes) or 'no node'}")
        result["node"] = down
        why = f"lmlaunch preempt --mode node-failure of job {victim.job_id}"
        # drained first: a failed node takes no job until it is RESUMEd, as a real one would not (DOWN alone
        # is undone by ReturnToService=2 the moment its slurmd registers again, within a second here, and
        # an expedited requeue (SLURM 26.05) was then started on it at once while it still killed the last run)
        rehearsal.set_node_state(down, "DRAIN", reason=why)
        rehearsal.set_node_state(down, "DOWN", reason=why)
        try:
            result.update(wait_requeued(victim, timeout=timeout, since=t0))
            # a failed node stays down until the job's tasks are gone from it (as a real one would)
            result["tasks_gone"] = wait_off_nodes(victim.job_id, [down], timeout=timeout,
                                                  job_runs_on=bool(result.get("restarted_in_place")))
        finally:
            result["node_resumed"] = resume_node(down)
    else:
        raise UserError(f"--mode {mode!r}: allowed: {', '.join(MODES)}")
    result["requeue_seconds"] = round(time.time() - t0, 3)
    if start_now and result.get("requeued"):
        result["started_now"] = start_when_pending(victim.job_id, victim.nodes)
    return result


def resume_node(node: str) -> bool:
    """Set ``node`` back to service. SLURM refuses RESUME for a node that is not DOWN/DRAINED;
    with ReturnToService=2 a DOWN node whose slurmd answers may already be back by itself."""
    try:
        rehearsal.set_node_state(node, "RESUME")
        return True
    except UserError:
        state = next((n.state for n in slurm.nodes() if n.name == node), "unknown")
        if state.rstrip("*~#!%$@^-+").startswith(("down", "drain", "fail")):
            raise
        return True  # already back in service


def _high_partition(profile_name: str, environ) -> str:
    profile = load_profile(profile_name, environ)
    if not profile.high_priority_partition:
        raise UserError(
            f"profile '{profile_name}' names no high_priority_partition to preempt from; pass --partition "
            f"(its partitions: {', '.join(profile.partitions)})"
        )
    return profile.high_priority_partition
