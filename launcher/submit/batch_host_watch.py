"""The run's watcher looking, from the login side, for a job with spare nodes whose batch script's
node failed and that nobody inside the job requeued (lmcore.run.lost_batch_host says when and how).

The job's keeper (lmtrain.task.keeper) does it from inside within seconds; SLURM 26.05 sometimes
kills the keeper's step with that node (its ``srun`` ran there), and a job in a container runs no
keeper: the job then stays RUNNING with nobody in it until its time limit (24.11, 26.05), or ends
FAILED and is never requeued (22.05). The watcher (launcher.submit.watcher.watch, started by submit
for such a run) asks SLURM about the job at each look, and requeues it only when the loss has
lasted ``GRACE_S``: long enough for a living keeper to have done it first (it looks every 10 s and
acts within SLURM's KillWait), so the two never requeue one loss twice.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launcher.planning import transport
from launcher.runs import registry as runs
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.run import lost_batch_host as lost

GRACE_S = 30.0  # a loss seen this long (three of the keeper's looks) is the watcher's to act on
POLL_S = 15.0  # how often a watcher of a run with spare nodes looks at its job


@dataclass
class BatchHostWatch:
    """One run's looks; ``since``: when the current loss was first seen (None: none seen)."""

    since: float | None = None

    def look_or_say(self, rec: runs.RunRecord, environ: dict[str, str] | None, say: Callable[[str], None]) -> bool:
        """:meth:`look`; SLURM that does not answer now is said and asked again at the next look."""
        try:
            return self.look(rec, environ, say)
        except (SlurmUnavailable, UserError) as exc:
            say(f"its cluster did not answer about the job's nodes ({exc.message}); trying again")
            return False

    def look(self, rec: runs.RunRecord, environ: dict[str, str] | None, say: Callable[[str], None],
             now: float | None = None) -> bool:
        """One look at the run's job; True while a loss is seen (the job must not be taken for ended yet)."""
        job = rec.last_job_id
        if not job:
            return False
        with transport.through(transport.job_target(rec, job, environ), exactly=True):
            info = lost.job_info(job)
            host_state = lost.node_state(info["BatchHost"]) if info and info.get("BatchHost") else ""
            what = self.decide(seen_lost(info, host_state, rec), time.time() if now is None else now)
            if what == "seen":
                say(f"job {job}: its batch script's node {(info or {}).get('BatchHost')} failed "
                    f"({host_state or 'out of the job'}, job {(info or {}).get('JobState')}); requeued here unless "
                    f"the job's keeper does it within {GRACE_S:.0f} s")
            elif what == "act":
                host = socket.gethostname()
                say(lost.requeue(Path(rec.run_dir), job, f"the run's watcher on {host}",
                                 {"watcher": host}))
            return what is not None

    def decide(self, lost_now: bool, now: float) -> str | None:
        """Pure: None (nothing lost), "seen" (a loss first seen), "wait" (within GRACE_S of it) or "act"."""
        if not lost_now:
            self.since = None
            return None
        if self.since is None:
            self.since = now
            return "seen"
        if now - self.since < GRACE_S:
            return "wait"
        self.since = None
        return "act"


def seen_lost(info: dict[str, str] | None, host_state: str, rec: runs.RunRecord) -> bool:
    """Whether the job needs requeueing now: running on without its batch script's node (not a node
    that only does not answer for a moment), or ended for it (22.05: FAILED, JobLaunchFailure)."""
    if info is None:
        return False
    if info.get("JobState") == "RUNNING" and not lost.lost_while_running(info, host_state):
        return False
    return lost.why_not(info, host_state, Path(rec.run_dir)) is None
