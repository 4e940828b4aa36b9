"""Rehearsing preemption and node failures on a real cluster (`lmlaunch preempt`, the tests,
bench/): SLURM admin actions a training run never takes itself, on top of the SLURM client."""

from __future__ import annotations

import time
from collections.abc import Iterable

from launcher.core.errors import SlurmUnavailable, UserError
from launcher.core.slurm import (
    DEFAULT_TIMEOUT_S,
    is_active,
    job_state,
    nodes,
    run,
    show_job,
    squeue,
    state_group,
    state_word,
)

SIGNAL_WAIT_S = 10.0  # scancel --signal: how long to wait for SLURM to settle after delivering it


def signal_steps(job_id: str, signal: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Send ``signal`` (e.g. 'USR2', 'TERM') to every task of every step of a job, not to the
    batch shell (plain `scancel --signal`: what SLURM's time-limit --signal without B: does)."""
    try:
        run(["scancel", f"--signal={signal}", str(job_id)], timeout=min(timeout, SIGNAL_WAIT_S))
    except SlurmUnavailable:
        # scancel delivers the signal at once, then retries while the job is "in transitional
        # state": a job array task that requeued itself at the signal stays so (slurm 22.05).
        # The signal was delivered if the job moved on from RUNNING.
        if state_word(job_state(str(job_id), timeout=timeout)) == "RUNNING":
            raise


def hostnames(nodelist: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """'n[1-2]' -> ['n1', 'n2'] (`scontrol show hostnames`)."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    proc = run(["scontrol", "show", "hostnames", nodelist], timeout=timeout)
    return [h.strip() for h in proc.stdout.splitlines() if h.strip()]


def submit_holder(
    *,
    name: str,
    partition: str,
    nodelist: str,
    num_nodes: int,
    seconds: int,
    output: str = "/dev/null",
    timeout: float = DEFAULT_TIMEOUT_S,
) -> str:
    """sbatch an `--exclusive` job that holds ``nodelist`` for ``seconds`` (a high-priority
    partition makes it preempt the low-priority jobs on those nodes); returns its job id."""
    minutes = max(1, -(-seconds // 60) + 1)
    proc = run(
        [
            "sbatch", "--parsable", "-J", name, "-p", partition, "-w", nodelist, "-N", str(num_nodes),
            "--exclusive", f"--time={minutes}", "-o", output, "-e", output, "--wrap", f"sleep {int(seconds)}",
        ],
        timeout=timeout,
    )
    return proc.stdout.strip().split(";")[0]


def set_node_state(node: str, state: str, reason: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """`scontrol update NodeName=NODE State=STATE [Reason=...]` (DOWN needs a reason; RESUME
    brings a DOWN or DRAINED node back)."""
    args = ["scontrol", "update", f"NodeName={node}", f"State={state}"]
    if reason is not None:
        args.append(f"Reason={reason}")
    run(args, timeout=timeout)


def start_now(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Let a requeued job start at once instead of after its ~2 min BeginTime delay."""
    run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=timeout)


def steps_left(job_id: str, names: Iterable[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Nodes (of ``names``, or all) where a run of ``job_id`` still has processes, as their own
    slurmd tells (`scontrol listpids JOB NODE`). A node set DOWN is back in service within a
    second (ReturnToService=2) while its slurmd may still be killing the job's previous run for
    ~10 s; the requeued job started there meanwhile is killed with it (same job id) and ends
    FAILED. slurmd answers listpids only on its own host (the local cluster's nodes); a node
    that cannot be asked is not listed."""
    wanted = list(names) if names is not None else [n.name for n in nodes(timeout=timeout)]
    left = []
    for name in wanted:
        proc = run(["scontrol", "listpids", str(job_id), name], timeout=timeout, check=False)
        rows = [line for line in proc.stdout.splitlines()[1:] if line.split()[:1] and line.split()[0].isdigit()]
        if proc.returncode == 0 and rows:
            left.append(name)
    return left


def ready_to_start(job_id: str, names: Iterable[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether a requeued job may be started now (`start_now`) without SLURM killing it: no node
    (of ``names``, or all) still completes a job, and none still runs the job's previous run."""
    wanted = list(names) if names is not None else None
    return not nodes_completing(wanted, timeout=timeout) and not steps_left(job_id, wanted, timeout=timeout)


def nodes_completing(names: Iterable[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Nodes (of ``names``, or all) still cleaning up a job (sinfo state `comp`/`*+comp`). A
    requeued job started on them before that finished, or within the second its credential was
    revoked, is killed by SLURM as "non-startable: Job credential revoked" and ends FAILED."""
    wanted = set(names) if names is not None else None
    return [n.name for n in nodes(timeout=timeout) if "comp" in n.state and (wanted is None or n.name in wanted)]


def wait_for(
    job_id: str,
    groups: Iterable[str],
    *,
    timeout: float,
    poll: float = 2.0,
    start_requeued: bool = False,
) -> str:
    """Poll until the job's state falls in one of ``groups`` (e.g. {'running'}); return the
    SLURM state. With ``start_requeued``, a job pending on its requeue BeginTime is started
    once it has waited 2 s and no node is still completing a job or running its previous run
    (:func:`ready_to_start`; started within the second of its requeue, SLURM kills it: 'Job
    credential revoked').
    Raises TimeoutError with the last state seen, the pending reason and what the nodes run."""
    wanted = set(groups)
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    pending_since: dict[str | None, float] = {}
    while True:
        state = job_state(job_id)
        if state_group(state) in wanted:
            return state
        if start_requeued and state == "PENDING":
            info = show_job(job_id) or {}
            if info.get("Reason") == "BeginTime":
                first = pending_since.setdefault(info.get("Restarts"), time.monotonic())
                if time.monotonic() - first >= 2.0 and ready_to_start(job_id):
                    start_now(job_id)
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s (waited for {sorted(wanted)})"
                               + _why_waiting(job_id))
        time.sleep(poll)


def _why_waiting(job_id: str) -> str:
    """For a timeout message: the job's reason and the other active jobs (best effort)."""
    try:
        info = show_job(job_id) or {}
        others = [f"{j.job_id} {j.name} {j.state} on {j.nodelist or '-'} ({j.partition})"
                  for j in squeue() if j.job_id != job_id and is_active(j.state)]
    except UserError:
        return ""
    return (f"; reason {info.get('Reason', '?')}, nodes {info.get('ReqNodeList', '?')}; other active jobs: "
            + ("; ".join(others) or "none"))
