"""The job's keeper: ``python -m lmtrain.task.keeper RUN_DIR LOG_FILE``, one small step on a node other than
the batch script's, in a job with spare nodes.

Such a job runs with ``sbatch --no-kill`` (a failed node leaves the allocation, a spare takes its
place). SLURM then treats the failure of the batch script's own node differently from a job
without it: it ends the job FAILED ("JobLaunchFailure"), never requeued (seen on 22.05; without
``--no-kill`` the same failure is NODE_FAIL and requeued), and rank 0, whose decision would requeue
it, ran on that node too. The chaos campaign found it (docs/chaos.md).

The keeper waits for that moment, doing little else: when SLURM ends the job it sends SIGTERM to
every step's tasks, this one too, and gives them KillWait before SIGKILL. SLURM 24.11 and 26.05 do
not end it: the job stays RUNNING on its other nodes, without a batch script or rank 0, and nobody
is signalled; so every ``LOOK_S`` the keeper also asks whether the batch script's node is DOWN or out
of the job while the job runs, and acts the same way then. What it decides and writes is
lmcore.run.lost_batch_host's, which the run's watcher on the login side shares: 26.05 sometimes
kills this step with the batch script's node (its ``srun`` ran there), and then the watcher sees it.
Any other end of the job (completed, preempted, a time limit, cancelled, a restart that leaves this
node out) leaves it nothing to do.

Imports nothing heavy (no torch): it starts in a fraction of a second and holds no memory to speak
of. The warning signal and the others SLURM may send are ignored; only SIGTERM wakes it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from lmcore.run import lost_batch_host

log = logging.getLogger("lmtrain.keeper")

WAKE = signal.SIGTERM
IGNORED = ("SIGUSR1", "SIGUSR2", "SIGURG", "SIGXCPU", "SIGHUP", "SIGINT", "SIGCONT")
LOOK_S = 10.0  # between two looks at the batch script's node while no signal comes (two scontrol calls)


def act(run_dir: Path, job_id: str) -> str:
    """SIGTERM came (or the look found the batch host lost): requeue the job if its batch script's node
    failed (lmcore.run.lost_batch_host)."""
    node = os.environ.get("SLURMD_NODENAME", "")
    return lost_batch_host.requeue(run_dir, job_id, f"the job's keeper on {node}", {"keeper": node})


def _own_output(path: str) -> None:
    """stdout and stderr into ``path``, opened here: not through the step's I/O, which srun on the failed
    node no longer reads (writes there stalled the keeper past KillWait: seen on 22.05)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)


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
    """Whether the job still runs while its batch script's node failed
    (lmcore.run.lost_batch_host.lost_while_running): SLURM 24.11 and 26.05 keep a ``--no-kill`` job
    RUNNING on its other nodes then, with no batch script and no rank 0, sending nobody a signal
    (seen in a chaos campaign: the job sat there until its time limit)."""
    info = lost_batch_host.job_info(job_id) or {}
    return info.get("JobState") == "RUNNING" and \
        lost_batch_host.lost_while_running(info, lost_batch_host.node_state(info.get("BatchHost", "")))


if __name__ == "__main__":
    sys.exit(main())
