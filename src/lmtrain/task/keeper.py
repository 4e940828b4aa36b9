"""The job's keeper: ``python -m lmtrain.task.keeper RUN_DIR LOG_FILE``, one small step on a node other than
the batch script's, in a job with spare nodes.

Such a job runs with ``sbatch --no-kill`` (a failed node leaves the allocation, a spare takes its
place). SLURM then treats the failure of the batch script's own node differently from a job
without it: it ends the job FAILED ("JobLaunchFailure"), never requeued (seen on 22.05; without
``--no-kill`` the same failure is NODE_FAIL and requeued), and rank 0, whose decision would requeue
it, ran on that node too. The chaos campaign found it (docs/chaos.md).

The keeper waits for that moment, doing little else: when SLURM ends the job it sends SIGTERM to
every step's tasks, this one too, and gives them KillWait before SIGKILL. SLURM 26.05 does not end
it: the job stays RUNNING on its other nodes, without a batch script or rank 0, and nobody is
signalled; so every ``LOOK_S`` the keeper also asks whether the batch script's node is DOWN while
the job runs, and acts the same way then. The keeper then asks
SLURM about the job: only where the batch script's node is DOWN (or failing), the job is not
cancelled, queued again or finished, and the run is not done, it runs ``scontrol requeue`` (SLURM
requeues a finished job as well as a running one) and writes the attempt's end line, which nobody
else could write: ``node_failure`` when the node is down or drained, ``crashed`` when it is up and
in service (the batch script itself was killed there: SLURM gives the same reason for that). Any other end of the job (completed, preempted, a
time limit, cancelled, a restart that leaves this node out) leaves it nothing to do.

Imports nothing heavy (no torch): it starts in a fraction of a second and holds no memory to speak
of. The warning signal and the others SLURM may send are ignored; only SIGTERM wakes it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("lmtrain.keeper")

WAKE = signal.SIGTERM
IGNORED = ("SIGUSR1", "SIGUSR2", "SIGURG", "SIGXCPU", "SIGHUP", "SIGINT", "SIGCONT")
NODE_LOST_REASONS = ("JobLaunchFailure",)  # SLURM removed the batch script's node (NodeDown: any node of the job)
TRIES = 20  # requeue attempts, a quarter second apart: within SLURM's KillWait (30 s by default)
LOOK_S = 10.0  # between two looks at the batch script's node while no signal comes (two scontrol calls)
PAUSE_S = 0.25


def run_unfinished(run_dir: Path) -> str | None:
    """None when the run still has work to do; else why not (cancelled, or DONE at its max_steps)."""
    from lmcore.run.run_layout import RunLayout, is_cancelled, read_done_step

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


def node_state(host: str) -> str:
    """`scontrol show node`'s State of ``host``; "" when SLURM does not say (taken as up: a requeue is
    never guessed)."""
    from lmcore.slurm import client as slurm

    try:
        return next((n.get("State", "") for n in slurm.node_configs() if n.get("NodeName") == host), "")
    except Exception as exc:
        log.warning("scontrol show node: %s", exc)
        return ""


def why_not(info: dict[str, str] | None, host_state: str, run_dir: Path) -> str | None:
    """Pure but for the run's markers: None when the keeper must requeue the job; else why not."""
    if info is None:
        return "SLURM does not answer about the job"
    state = info.get("JobState", "")
    if state not in ("RUNNING", "COMPLETING", "FAILED", "NODE_FAIL"):
        return f"the job is {state or 'unknown'}"
    # SLURM's reason for a job whose batch node it removed (the node may be back already: an admin's DOWN
    # on a node whose slurmd answers turns IDLE+DRAIN within a second under ReturnToService=2)
    if not failed_state(host_state) and info.get("Reason") not in NODE_LOST_REASONS and not left_job(info):
        return (f"the batch script's node {info.get('BatchHost', '?')} is up ({host_state or 'state unknown'}) "
                f"and SLURM's reason is {info.get('Reason') or 'none'}")
    return run_unfinished(run_dir)


def what_ended(info: dict[str, str], host_state: str) -> tuple[str, str]:
    """Pure: the ledger's (reason, detail) for a job the keeper requeues. Its batch script's node DOWN,
    failing or drained when the keeper looks (within KillWait: a node that truly failed is not back
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


def _end_line(run_dir: Path, job_id: str, info: dict[str, str], host_state: str, node: str) -> None:
    """The attempt's end line, which its rank 0 never wrote (its node failed, or nobody asked it to
    decide), unless it did meanwhile."""
    from lmcore.run.run_layout import RunLayout
    from lmcore.run.rundir import AttemptEnd, Ledger

    ledger = Ledger(RunLayout.of(run_dir).ledger)
    open_ = [a for a in ledger.attempts() if a.reason is None]
    if not open_:
        return
    last = open_[-1]
    from lmcore.run.checkpoint_index import newest_complete

    ckpt = newest_complete(RunLayout.of(run_dir).checkpoints, files=False)
    reason, what = what_ended(info, host_state)
    ledger.write_end_once(AttemptEnd(
        attempt=last.attempt, job_id=job_id, time=time.time(),
        end_step=ckpt.step if ckpt is not None else last.start_step, reason=reason, requeued=True,
        detail=f"{what}: SLURM ended the job (spare nodes: --no-kill), and the job's keeper on {node} requeued it",
        extra={"keeper": node, "failed_node" if reason == "node_failure" else "batch_host": info.get("BatchHost", "")}))


def act(run_dir: Path, job_id: str) -> str:
    """SIGTERM came: requeue the job if its batch script's node failed (see the module's doc)."""
    from lmcore.slurm import client as slurm
    from lmtrain.preemption.slurm_facts import job_facts

    node = os.environ.get("SLURMD_NODENAME", "")
    for _ in range(TRIES):
        info = job_facts(job_id)
        host = (info or {}).get("BatchHost", "")
        host_state = node_state(host) if host else ""
        log.info("job %s: %s; node %s %s", job_id, {k: (info or {}).get(k) for k in ("JobState", "Reason", "ExitCode")},
                 host, host_state)
        reason = why_not(info, host_state, run_dir)
        if reason is not None:
            return f"nothing to do: {reason}"
        try:
            slurm.requeue(job_id)
        except Exception as exc:  # SLURM busy with the job's end: again, within KillWait
            log.warning("scontrol requeue %s: %s", job_id, exc)
            time.sleep(PAUSE_S)
            continue
        released = _release(job_id)
        _end_line(run_dir, job_id, info or {}, host_state, node)
        return f"{what_ended(info or {}, host_state)[1]}: job {job_id} requeued{released}"
    return f"job {job_id}: scontrol requeue kept failing"


def _own_output(path: str) -> None:
    """stdout and stderr into ``path``, opened here: not through the step's I/O, which srun on the failed
    node no longer reads (writes there stalled the keeper past KillWait: seen on 22.05)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)


def _release(job_id: str) -> str:
    """SLURM holds a job requeued after its batch launch failed (Reason launch_failed_requeued_held,
    priority 0): release it, so it starts as a preempted one would."""
    from lmcore.slurm import client as slurm
    from lmtrain.preemption.slurm_facts import job_facts

    info = job_facts(job_id) or {}
    if info.get("Reason") != "launch_failed_requeued_held" and info.get("Priority") != "0":
        return ""
    try:
        slurm.hold(job_id, release=True)
    except Exception as exc:
        log.warning("scontrol release %s: %s", job_id, exc)
        return f" (held by SLURM: {info.get('Reason')}; the release failed: {exc})"
    return f" and released (SLURM held it: {info.get('Reason')})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m lmtrain.task.keeper RUN_DIR LOG_FILE", file=sys.stderr)
        return 2
    _own_output(args[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper: %(message)s", stream=sys.stderr)
    for name in IGNORED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {WAKE})
    job_id = os.environ.get("SLURM_JOB_ID", "")
    log.info("keeping job %s on %s", job_id, os.environ.get("SLURMD_NODENAME", "?"))
    while signal.sigtimedwait({WAKE}, LOOK_S) is None and not batch_host_lost(job_id):
        pass
    log.info("%s", act(Path(args[0]), job_id))
    return 0


def batch_host_lost(job_id: str) -> bool:
    """Whether the job still runs while its batch script's node failed (:func:`lost_while_running`):
    SLURM 26.05 keeps a ``--no-kill`` job RUNNING on its other nodes then, with no batch script and
    no rank 0, sending nobody a signal (seen in a chaos campaign: the job sat there until its time
    limit). Not a node that only does not answer for a moment (NOT_RESPONDING under load)."""
    from lmtrain.preemption.slurm_facts import job_facts

    info = job_facts(job_id) or {}
    return info.get("JobState") == "RUNNING" and lost_while_running(info, node_state(info.get("BatchHost", "")))


def left_job(info: dict[str, str]) -> bool:
    """Pure: the batch script's node is no longer among the job's nodes (SLURM removed it, failed)."""
    from lmtrain.preemption.slurm_facts import held_nodes

    held = held_nodes(info)
    return bool(info.get("BatchHost")) and held is not None and info.get("BatchHost") not in held


def lost_while_running(info: dict[str, str], host_state: str) -> bool:
    """Pure: the job RUNNING and its batch script's node out of its allocation (SLURM removed the failed
    node: 26.05 returned it to service a second later, ReturnToService=2, but not to the job) or DOWN or
    failed now (not only NOT_RESPONDING)."""
    words = host_state.upper().split("+")
    return info.get("JobState") == "RUNNING" and bool(info.get("BatchHost")) and (
        left_job(info) or any(word in words for word in ("DOWN", "FAIL", "FAILING")) or host_state.upper().startswith("DOWN"))


if __name__ == "__main__":
    sys.exit(main())
