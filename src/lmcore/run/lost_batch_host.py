"""A job with spare nodes whose batch script's node failed: the one decision to requeue it, and the
requeue, for the two that watch for it (the job's keeper on another node, lmtrain.task.keeper; the
run's watcher on the login side, launcher.submit.watcher).

Such a job runs with ``sbatch --no-kill`` (a failed node leaves the allocation, a spare takes its
place). When the batch script's own node fails, rank 0 (whose decision would requeue the job) and
the script (whose restart loop would restart it) go with it, and SLURM does not requeue it: 22.05
ends it FAILED ("JobLaunchFailure"); 24.11 and 26.05 keep it RUNNING on its other nodes with nobody
in it until its time limit. The keeper covers both while its step lives; 26.05 sometimes kills the
keeper's step with the node (its ``srun`` ran there), and then only the watcher outside the job is
left to see it.

The decision is pure but for the run's markers (:func:`why_not`): only where the batch script's node
is DOWN, failing or out of the job, or the script itself was SIGKILLed (:func:`batch_killed`), the
job is not cancelled, queued again or finished, and the run has work left. The requeue writes the
attempt's end line nobody else could: ``node_failure`` when the node is down, drained or out of the
job, ``crashed`` when it is up and in service (the batch script itself was killed there: SLURM gives
the same reason for that).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from lmcore.run.checkpoint_index import newest_complete
from lmcore.run.run_layout import RunLayout, checkpoint_dir_of, is_cancelled, read_done_step
from lmcore.run.rundir import AttemptEnd, Ledger
from lmcore.slurm import client as slurm

log = logging.getLogger("lmcore.lost_batch_host")

NODE_LOST_REASONS = ("JobLaunchFailure",)  # SLURM removed the batch script's node (NodeDown: any node of the job)
TRIES = 20  # requeue attempts, a quarter second apart: within SLURM's KillWait (30 s by default)
PAUSE_S = 0.25
QUERY_S = 10.0  # each question to SLURM: one that does not answer in time is decided without


def run_unfinished(run_dir: Path) -> str | None:
    """None when the run still has work to do; else why not (cancelled, or DONE at its max_steps)."""
    if is_cancelled(run_dir):
        return "the run is cancelled"
    done, step = read_done_step(run_dir)
    if not done:
        return None
    try:
        max_steps = int(json.loads(RunLayout.of(run_dir).plan.read_text())["trainer"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return "the run is done"
    return None if step is not None and step < max_steps else "the run is done"


def failed_state(state: str) -> bool:
    """Pure: whether `scontrol show node`'s State says the node failed (DOWN, DOWN+DRAIN,
    DOWN+NOT_RESPONDING, FAIL...), not only drained (sinfo says "drain" for DOWN+DRAIN)."""
    return any(word in state.upper().split("+") for word in ("DOWN", "FAIL", "FAILING", "NOT_RESPONDING")) or \
        state.upper().startswith("DOWN")


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol show job`, or None when SLURM does not answer in time (decided without it)."""
    try:
        return slurm.show_job(job_id, timeout=QUERY_S)
    except Exception as exc:  # SLURM down, no client, a timeout
        log.warning("could not read the state of job %s from SLURM: %s", job_id, exc)
        return None


def node_state(host: str) -> str:
    """`scontrol show node`'s State of ``host``; "" when SLURM does not say (taken as up: a requeue is
    never guessed)."""
    try:
        return next((n.get("State", "") for n in slurm.node_configs(timeout=QUERY_S) if n.get("NodeName") == host), "")
    except Exception as exc:
        log.warning("scontrol show node: %s", exc)
        return ""


def left_job(info: dict[str, str]) -> bool:
    """Pure: the batch script's node is no longer among the job's nodes (SLURM removed it, failed)."""
    held = info.get("NodeList", "")
    if not held or held in ("(null)", "None") or not info.get("BatchHost"):
        return False
    from hostlist import expand_hostlist

    return info["BatchHost"] not in expand_hostlist(held)


def lost_while_running(info: dict[str, str], host_state: str) -> bool:
    """Pure: the job RUNNING and its batch script's node out of its allocation (SLURM removed the failed
    node: 26.05 returned it to service a second later, ReturnToService=2, but not to the job) or DOWN or
    failed now (not only NOT_RESPONDING, which a node under load is for a moment)."""
    words = host_state.upper().split("+")
    return info.get("JobState") == "RUNNING" and bool(info.get("BatchHost")) and (
        left_job(info) or any(word in words for word in ("DOWN", "FAIL", "FAILING")) or host_state.upper().startswith("DOWN"))


def batch_killed(info: dict[str, str]) -> str | None:
    """Pure: SLURM's words when it ended the job because its batch script was SIGKILLed with the ranks
    running (the OOM killer, a kill -9: 26.05 says FAILED, Reason RaisedSignal:9(Killed), ExitCode 0:9,
    and COMPLETING while it ends; 22.05 JobLaunchFailure), else None. Not a cancel (CANCELLED) or a time
    limit (TIMEOUT): the run's work is not done and nobody asked for the end."""
    code = info.get("ExitCode", "")
    killed = code.count(":") == 1 and code.split(":")[1] == "9"
    if killed and slurm.state_word(info.get("JobState")) in ("FAILED", "COMPLETING"):
        return f"SIGKILL; SLURM: {info.get('Reason') or 'no reason'}, ExitCode {code}"
    return None


def why_not(info: dict[str, str] | None, host_state: str, run_dir: Path) -> str | None:
    """Pure but for the run's markers: None when the job must be requeued; else why not."""
    if info is None:
        return "SLURM does not answer about the job"
    state = info.get("JobState", "")
    if state not in ("RUNNING", "COMPLETING", "FAILED", "NODE_FAIL"):
        return f"the job is {state or 'unknown'}"
    # SLURM's reason for a job whose batch node it removed (the node may be back already: an admin's DOWN
    # on a node whose slurmd answers turns IDLE+DRAIN within a second under ReturnToService=2)
    if not failed_state(host_state) and info.get("Reason") not in NODE_LOST_REASONS and not left_job(info) \
            and batch_killed(info) is None:
        return (f"the batch script's node {info.get('BatchHost', '?')} is up ({host_state or 'state unknown'}) "
                f"and SLURM's reason is {info.get('Reason') or 'none'}")
    return run_unfinished(run_dir)


def what_ended(info: dict[str, str], host_state: str) -> tuple[str, str]:
    """Pure: the ledger's (reason, detail) for a job requeued here. Its batch script's node DOWN,
    failing or drained when it is looked at (within KillWait: a node that truly failed is not back
    so soon) -> ``node_failure``; a node up and in service -> its batch script was killed there
    (SLURM says JobLaunchFailure, ExitCode 0:9, for that too: seen in a chaos campaign) -> ``crashed``."""
    host = info.get("BatchHost", "?")
    if failed_state(host_state) or "DRAIN" in host_state.upper().split("+"):
        return "node_failure", f"node {host} of the batch script and rank 0 failed ({host_state})"
    if left_job(info):
        return "node_failure", f"node {host} of the batch script and rank 0 failed: SLURM took it out of the job"
    code = info.get("ExitCode", "")
    sig = code.split(":")[1] if code.count(":") == 1 and code.split(":")[1] not in ("", "0") else ""
    return "crashed", (f"the batch script on {host} ended (SLURM: {info.get('Reason')}, ExitCode {code or '?'}"
                       f"{': killed by signal ' + sig if sig else ''}) while its node stayed up ({host_state or '?'})")


def requeue(run_dir: Path, job_id: str, by: str, who: dict[str, str]) -> str:
    """Requeue the job if its batch script's node failed (:func:`why_not`), and write the attempt's end
    line; ``by`` says who did it in that line ("the job's keeper on n2"), ``who`` goes into its fields.
    What was done, or why nothing."""
    for _ in range(TRIES):
        info = job_info(job_id)
        host = (info or {}).get("BatchHost", "")
        host_state = node_state(host) if host else ""
        log.info("job %s: %s; node %s %s", job_id, {k: (info or {}).get(k) for k in ("JobState", "Reason", "ExitCode")},
                 host, host_state)
        reason = why_not(info, host_state, run_dir)
        if reason is not None:
            return f"nothing to do: {reason}"
        try:
            slurm.requeue(job_id, timeout=QUERY_S)
        except Exception as exc:  # SLURM busy with the job's end: again, within KillWait
            log.warning("scontrol requeue %s: %s", job_id, exc)
            time.sleep(PAUSE_S)
            continue
        released = _release(job_id)
        _end_line(run_dir, job_id, info or {}, host_state, by, who)
        return f"{what_ended(info or {}, host_state)[1]}: job {job_id} requeued{released}"
    return f"job {job_id}: scontrol requeue kept failing"


def _end_line(run_dir: Path, job_id: str, info: dict[str, str], host_state: str, by: str, who: dict[str, str]) -> None:
    """The attempt's end line, which its rank 0 never wrote (its node failed, or nobody asked it to
    decide), unless it did meanwhile."""
    ledger = Ledger(RunLayout.of(run_dir).ledger)
    open_ = [a for a in ledger.attempts() if a.reason is None]
    if not open_:
        return
    last = open_[-1]
    ckpt = newest_complete(checkpoint_dir_of(run_dir), files=False)  # the spec's checkpoint.dir
    reason, what = what_ended(info, host_state)
    ledger.write_end_once(AttemptEnd(
        attempt=last.attempt, job_id=job_id, time=time.time(),
        end_step=ckpt.step if ckpt is not None else last.start_step, reason=reason, requeued=True,
        detail=f"{what}: SLURM did not requeue the job (spare nodes: --no-kill), and {by} requeued it",
        extra={**who, "failed_node" if reason == "node_failure" else "batch_host": info.get("BatchHost", "")}))


def _release(job_id: str) -> str:
    """SLURM holds a job requeued after its batch launch failed (Reason launch_failed_requeued_held,
    priority 0): release it, so it starts as a preempted one would."""
    info = job_info(job_id) or {}
    if info.get("Reason") != "launch_failed_requeued_held" and info.get("Priority") != "0":
        return ""
    try:
        slurm.hold(job_id, release=True, timeout=QUERY_S)
    except Exception as exc:
        log.warning("scontrol release %s: %s", job_id, exc)
        return f" (held by SLURM: {info.get('Reason')}; the release failed: {exc})"
    return f" and released (SLURM held it: {info.get('Reason')})"
