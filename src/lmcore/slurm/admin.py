"""SLURM admin actions a training run never takes itself, for rehearsing preemption and node
failures on a real cluster (`lmlaunch preempt`, the tests, bench/): signals to a job's steps,
a holder job that preempts, node states, a requeued job started at once, what a node still runs.
On top of :mod:`lmcore.slurm.client`; the login side's only SLURM writes besides submission."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from lmcore.errors import SlurmUnavailable
from lmcore.slurm.client import DEFAULT_TIMEOUT_S, config, job_state, nodes, run, state_word

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


def set_time_limit(job_id: str, minutes: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """`scontrol update JobId=JOB TimeLimit=MINUTES` (an operator may lower a running job's limit;
    raising one back takes an operator too): the job meets its time limit, warning signal first,
    as it would at the end of its allocation."""
    run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={int(minutes)}"], timeout=timeout)


def start_now(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Let a requeued job start at once instead of after its ~2 min BeginTime delay."""
    run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=timeout)


def step_sockets(spool_dir: str, node: str, job_id: str) -> list[Path]:
    """The step daemons' sockets of ``job_id`` in ``node``'s spool directory (SlurmdSpoolDir, its
    %n the node): one per step whose slurmstepd still runs, the batch step's included. A socket
    file whose daemon died without removing it (SIGKILLed with its node) is not one: only paths
    a live socket is bound to count (/proc/net/unix), when this machine can tell."""
    if not spool_dir:
        return []
    found = sorted(Path(spool_dir.replace("%n", node)).glob(f"{node}_{job_id}.*"))
    bound = _bound_unix_paths()
    return found if bound is None else [p for p in found if str(p) in bound]


def _bound_unix_paths() -> set[str] | None:
    """The paths unix sockets are bound to on this machine, None when /proc does not say."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return None
    return {parts[7] for parts in (line.split() for line in lines) if len(parts) >= 8}


def steps_left(job_id: str, names: Iterable[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Nodes (of ``names``, or all) where a run of ``job_id`` still has processes, as their own
    slurmd tells (`scontrol listpids JOB NODE`). A node set DOWN is back in service within a
    second (ReturnToService=2) while its slurmd may still be killing the job's previous run for
    ~10 s; the requeued job started there meanwhile is killed with it (same job id) and ends
    FAILED. slurmd answers listpids only on its own host (the local cluster's nodes); a node
    that cannot be asked is not listed.

    A node whose tasks are gone may still hold the run's step daemon for a moment, and a new run
    started meanwhile is killed with it: a node whose spool directory (readable here: the local
    cluster's nodes) still holds a step daemon's socket of the job (``<node>_<job>.<step>``,
    removed as the daemon exits) counts too."""
    wanted = list(names) if names is not None else [n.name for n in nodes(timeout=timeout)]
    spool = config(timeout=timeout).get("SlurmdSpoolDir", "")
    held = [n for n in wanted if step_sockets(spool, n, job_id)]
    left = list(held)
    for name in (n for n in wanted if n not in held):
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


