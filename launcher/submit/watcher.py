"""The run's watcher: `lmlaunch move RUN --watch`, which `lmlaunch submit` starts in the background
beside a run over several clusters (it moves the queued job when a move is due: launcher.submit.mover;
it copies the files of a cluster over SSH back) and beside a run with spare nodes (it requeues the job
when its batch script's node failed and nobody in the job could: launcher.submit.batch_host_watch).

It asks the run's cluster about its current job every ``move.poll_s`` (30 s for a copy over SSH
alone, 15 s where it watches the batch script's node), holds ``RUN/mover.lock`` (one at a time; a
killed one's lock goes with its process), writes ``RUN/logs/mover.log``, and ends when the run does
(DONE, CANCELLED, its job ended without a requeue, its directory gone) or when its cluster has not
answered for an hour.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher.context import Context
from launcher.planning import transport
from launcher.planning.clusters import Queued, move_due
from launcher.runs import far_copy, registry as runs
from launcher.submit import mover
from launcher.submit.batch_host_watch import POLL_S, BatchHostWatch
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.run import rundir
from lmcore.slurm import client as slurm

__all__ = ["start_watcher", "watch"]
FAR_POLL_S = 30.0  # a run without a move section: how often its copy over SSH is brought back
HOST_POLL_S = POLL_S  # a run with spare nodes: how often its batch script's node is looked at
ENDED_LOOKS = 3  # the run's job unknown to its cluster this many looks in a row: the run ended
UNANSWERED_S = 3600.0  # its cluster silent this long (gone, or torn down): the watcher ends, saying so


def watch(rec: runs.RunRecord, ctx: Context) -> int:
    """Watch the run until it ends, moving its queued job when a move is due (one watcher per run)."""
    layout = rundir.RunLayout.of(rec.run_dir)
    lock = open(layout.mover_lock, "a")
    if not _take(lock):
        ctx.out(f"run '{rec.name}': a watcher already runs (it holds {layout.mover_lock})")
        return 0
    move_spec, host_watch, poll_s, described = _what_to_watch(rec, ctx)

    def say(text: str) -> None:
        ctx.out(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}")
        ctx.stdout.flush()

    say(described)
    misses, said, lost, silent_since = 0, "", False, None
    while True:
        if not layout.run_dir.is_dir():  # removed (or its filesystem gone): nothing left to watch for
            say(f"the run directory {layout.run_dir} is gone: the watcher ends")
            return 0
        rec = runs.load_record(rec.name, ctx.environ or None) or rec
        _copy_back(rec, say)
        if layout.done.exists() or layout.cancelled.exists():
            say("the run is " + ("done" if layout.done.exists() else "cancelled") + ": the watcher ends")
            return 0
        if lost:  # a failed move left it queued nowhere: queue it again before anything else
            lost = not mover.requeue_lost(rec, ctx, say)
            time.sleep(poll_s)
            continue
        try:
            q = mover.current_job(rec, ctx.environ or None)
            silent_since = None
        except (SlurmUnavailable, UserError) as exc:
            silent_since = silent_since or time.time()
            if _gave_up(time.time() - silent_since, exc, rec, say):
                return 1
            time.sleep(poll_s)
            continue
        if host_watch is not None and host_watch.look_or_say(rec, ctx.environ or None, say):
            time.sleep(poll_s)
            continue  # its batch script's node failed: requeued by the keeper or here, not ended
        misses = misses + 1 if q is None or not slurm.is_active(q.state) else 0
        if misses >= ENDED_LOOKS and _done_only_there(rec):
            misses = 0  # done on a cluster over SSH, not yet here: brought back at the next look
        if misses >= ENDED_LOOKS:
            say(f"job {rec.last_job_id} ended and is not queued again: the watcher ends")
            return 0
        why = move_due(q, after_s=move_spec.after_s, on_preemption=move_spec.on_preemption) \
            if q and move_spec is not None else None
        if q is not None and why is not None:
            try:
                said = _move_if_sooner(rec, q, why, ctx, say, said)
            except mover.NothingQueued as exc:
                say(exc.message)
                lost = True
            except (SlurmUnavailable, UserError) as exc:  # a cluster or a plan that fails now: said, tried again
                say(f"no move now: {exc.message}")
        time.sleep(poll_s)


def _take(lock: Any) -> bool:
    """The watcher's lock, held until its process ends; False when another watcher holds it (a
    look by `status`, launcher.runs.run_lock.watcher_alive, holds it shared for an instant: tried
    again a few times)."""
    for _ in range(10):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.1)
    return False


def _gave_up(silent_s: float, exc: UserError, rec: runs.RunRecord, say: Any) -> bool:
    """Its cluster did not answer: said; True once it has been silent for UNANSWERED_S."""
    if silent_s <= UNANSWERED_S:
        say(f"its cluster did not answer ({exc.message}); trying again")
        return False
    say(f"its cluster has not answered for {UNANSWERED_S / 3600:g} h ({exc.message}): the watcher ends "
        f"(again: lmlaunch move {rec.name} --detach)")
    return True


def _what_to_watch(rec: runs.RunRecord, ctx: Context) -> tuple[Any, BatchHostWatch | None, float, str]:
    """The run's move section, the watch of its batch script's node (spare nodes), how often to look,
    and the watcher's first line; a run with none of them (nor clusters over SSH) has nothing to
    watch for."""
    plans = mover.plans_of(rec, ctx, one=True)
    several = bool(plans[0].spec.clusters)
    move_spec = plans[0].spec.move if several else None
    over_ssh = [p.profile.name for p in plans if p.profile.login is not None] if several else []
    host_watch = BatchHostWatch() if plans[0].plan.slurm.spare_nodes else None
    if move_spec is None and not over_ssh and host_watch is None:
        raise UserError(f"run '{rec.name}' has no move section and no spare nodes: there is nothing to watch for",
                        exit_code=2)
    poll_s = min(move_spec.poll_s if move_spec is not None else FAR_POLL_S if over_ssh else HOST_POLL_S,
                 HOST_POLL_S if host_watch is not None else float("inf"))
    described = (f"watching run '{rec.name}' (" + (f"move.after {move_spec.after}, on_preemption "
                 f"{move_spec.on_preemption}, " if move_spec is not None else "no move section: ")
                 + (f"its copies on {', '.join(over_ssh)} kept in step, " if over_ssh else "")
                 + ("its batch script's node (spare nodes), " if host_watch is not None else "") + f"every {poll_s:g} s)")
    return move_spec, host_watch, poll_s, described


def _copy_back(rec: runs.RunRecord, say: Any) -> None:
    """The run's files back from the cluster over SSH its last job went to (its ledger merged).
    Once it is done there and its job has ended (its last lines written), its newest checkpoint
    too (the final weights), checked here, and then DONE here: done here means all of it is here."""
    far = far_copy.of_record(rec, rec.last_job_id)
    layout = rundir.RunLayout.of(rec.run_dir)
    if far is None or layout.done.exists():
        return
    try:
        far_copy.pull(layout.run_dir, far)
        if (done := far_copy.done_there(far)) is None or _still_there(rec):
            return
        name = far_copy.pull(layout.run_dir, far, checkpoint=True)  # and the lines written since
        layout.done.write_text(done)
        say(f"the run is done on {far.cluster}: its files and checkpoint {name or '(none)'} copied back, checked")
    except (far_copy.CopyFailed, UserError, SlurmUnavailable) as exc:
        say(f"copying back from {far.where} failed ({exc.message}); trying again")
    except (OSError, ValueError) as exc:  # a full disk here, a listing it could not read: the watcher goes on
        say(f"copying back from {far.where} failed ({exc}); trying again")


def _done_only_there(rec: runs.RunRecord) -> bool:
    """Whether the copy over SSH the run's last job ran on is done while this directory is not."""
    far = far_copy.of_record(rec, rec.last_job_id)
    if far is None or rundir.RunLayout.of(rec.run_dir).done.exists():
        return False
    try:
        return far_copy.done_there(far) is not None
    except far_copy.CopyFailed:
        return True  # not reachable now: it may be; look again


def _still_there(rec: runs.RunRecord) -> bool:
    """Whether the run's last job is still queued or running on its cluster."""
    job = rec.last_job_id or ""
    with transport.through(transport.job_target(rec, job), exactly=True):
        return any(j.job_id == job and slurm.is_active(j.state) for j in slurm.squeue([job]))


def _move_if_sooner(rec: runs.RunRecord, q: Queued, why: str, ctx: Context, say: Any, said: str) -> str:
    """One look at the clusters for a due move (their answers said when they changed), and the
    move where another starts it sooner; what was said last."""
    dest, lines = mover.decide(rec, q, ctx)
    if "\n".join(lines) != said:
        for line in lines:
            say(line)
        said = "\n".join(lines)
    if dest is not None:
        job = mover.move(rec, q, dest, why, ctx, say)
        if job:
            say(f"moved to {dest.profile.name}: job {job}")
        said = ""
    return said


def start_watcher(run: str, run_dir: str, ctx: Context) -> int:
    """`lmlaunch move RUN --watch` in the background, writing RUN/logs/mover.log; its pid."""
    layout = rundir.RunLayout.of(run_dir)
    layout.logs.mkdir(parents=True, exist_ok=True)
    with open(layout.mover_log, "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from launcher.cli import main; sys.exit(main())", "move", run, "--watch"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(Path(run_dir)),
            env={**os.environ, **(ctx.environ or {})})
    return proc.pid
