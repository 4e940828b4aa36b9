"""What SLURM says about this job, asked from the main loop only (never from a signal handler),
each query with a timeout; when SLURM does not answer the decision is made without it."""

from __future__ import annotations

import logging
import time
from typing import Any

from lmcore.slurm import client as slurm

SLURM_QUERY_TIMEOUT_S = 10.0  # every query: SLURM that does not answer in time is decided without

log = logging.getLogger(__name__)


def job_facts(job_id: str) -> dict[str, str] | None:
    """`scontrol show job` of this job, or None when SLURM does not answer in time."""
    try:
        return slurm.show_job(job_id, timeout=SLURM_QUERY_TIMEOUT_S)
    except Exception as exc:  # SLURM down, no client, a timeout: decide without it
        log.warning("could not read the state of job %s from SLURM: %s", job_id, exc)
        return None


def seconds_left(info: dict[str, str] | None, at: float) -> float | None:
    """Seconds from ``at`` to the job's time limit: StartTime + TimeLimit. Not EndTime: when
    SLURM preempts a job it moves EndTime to now + GraceTime (seen on 22.05), which would read
    as "at the time limit" and turn every preemption into a timeout."""
    info = info or {}
    start = slurm.parse_time(info.get("StartTime"))
    limit = slurm.parse_duration(info.get("TimeLimit"))
    return None if start is None or limit is None else start + limit - at


def nodes_down(nodes: list[str]) -> list[str]:
    """Which of ``nodes`` SLURM has DOWN / failing now (sinfo), from the main loop only."""
    try:
        states = {n.name: n.state for n in slurm.nodes(timeout=SLURM_QUERY_TIMEOUT_S)}
    except Exception as exc:
        log.warning("could not read the node states from SLURM: %s", exc)
        return []
    return [n for n in nodes if states.get(n, "").rstrip("*~#!%$@^-+").startswith(("down", "fail"))]


def held_nodes(info: dict[str, str]) -> list[str] | None:
    """The job's nodes now (`scontrol show job`'s NodeList; a failed node leaves it); None when
    SLURM gives none."""
    held = info.get("NodeList", "")
    if not held or held in ("(null)", "None"):
        return None
    from hostlist import expand_hostlist

    return list(expand_hostlist(held))


def left_allocation(nodes: list[str], info: dict[str, str]) -> list[str]:
    """Which of ``nodes`` the running job no longer holds: SLURM took a failed node out of a job
    that keeps running (sbatch --no-kill, spare nodes). With ReturnToService=2 such a node may be
    back in service, no longer DOWN, by the time rank 0 asks (seen on the local cluster)."""
    held = held_nodes(info)
    if slurm.state_word(info.get("JobState")) != "RUNNING" or held is None:
        return []
    return [n for n in nodes if n not in held]


def nodes_failed(env: Any, info: dict[str, str]) -> list[str]:
    """Nodes of this attempt that failed: DOWN in sinfo now, or, when SLURM already requeued the
    job while it runs (Restarts grew: it does so at once on a node failure, only after the tasks
    ended on a preemption), NODE_FAIL in accounting for this attempt. A DOWN node whose slurmd
    still answers may be back in service within seconds (ReturnToService=2), hence both."""
    down = nodes_down(env.nodes) or left_allocation(env.nodes, info)
    restarts = info.get("Restarts", "")
    if down or not restarts.isdigit() or int(restarts) <= env.restart_count:
        return down
    for _ in range(6):  # accounting lags the controller by a moment
        try:
            rows = slurm.sacct([env.job_id], duplicates=True, timeout=SLURM_QUERY_TIMEOUT_S)
        except Exception as exc:
            log.warning("could not read job %s from accounting: %s", env.job_id, exc)
            return []
        if len(rows) > env.restart_count and slurm.state_word(rows[env.restart_count].state):
            word = slurm.state_word(rows[env.restart_count].state)
            if word == "NODE_FAIL":
                return [f"{rows[env.restart_count].nodes} (NODE_FAIL)"]
            if word not in ("RUNNING", "COMPLETING", "PENDING"):
                return []
        time.sleep(0.5)
    return []


# Terminal states accounting records for an attempt the moment SLURM ends it (the controller
# shows them all as COMPLETING while the tasks still run).
_ENDING_STATES = ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "FAILED", "OUT_OF_MEMORY", "DEADLINE")


def why_completing(env: Any, info: dict[str, str] | None) -> str | None:
    """The real state behind ``JobState=COMPLETING`` (slurm 22.05 prints COMPLETING for a job
    being cancelled, timed out, failed or requeued): this attempt's row in accounting."""
    info = info or {}
    if slurm.state_word(info.get("JobState")) != "COMPLETING":
        return None
    restarts = info.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > env.restart_count:
        return None  # a requeue: the Restarts rule already covers it
    for _ in range(6):  # accounting lags the controller by a moment
        try:
            rows = slurm.sacct([env.job_id], duplicates=True, timeout=SLURM_QUERY_TIMEOUT_S)
        except Exception as exc:
            log.warning("could not read job %s from accounting: %s", env.job_id, exc)
            return None
        row = rows[env.restart_count] if len(rows) > env.restart_count else (rows[-1] if rows else None)
        if row is not None and slurm.state_word(row.state) in _ENDING_STATES:
            return row.state
        time.sleep(0.5)
    return None


def previous_attempt_state(job_id: str) -> str | None:
    """SLURM accounting's state of the previous run of this job (`sacct -D`), if it has one."""
    try:
        rows = slurm.sacct([job_id], duplicates=True, timeout=SLURM_QUERY_TIMEOUT_S)
    except Exception as exc:
        log.warning("could not read the earlier attempts of job %s from accounting: %s", job_id, exc)
        return None
    return rows[-2].state if len(rows) >= 2 else None
