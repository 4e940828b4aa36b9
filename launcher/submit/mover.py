"""Moving a run over several clusters (the spec's ``clusters`` and ``move``): the watcher that
`lmlaunch submit` starts beside such a run (`lmlaunch move RUN --watch`), and one move.

The watcher asks the run's cluster about its current job every ``move.poll_s``. When the job
waits in the queue and a move is due (after a preemption, or past ``move.after``:
launcher.planning.clusters.move_due), it asks every named cluster when the run would start there
(sbatch --test-only) and moves it where it starts more than a minute sooner:

1. the queued job is held (``scontrol hold``): it cannot start while the move goes on; a job that
   started meanwhile is released and left alone (only a queued job moves, never a running one);
2. it is cancelled, and the watcher waits until its cluster no longer lists it as queued;
3. the run is submitted on the other cluster as ``submit --resume`` would (its code snapshot,
   its newest complete checkpoint, on the run directory the clusters share);
4. the ledger says so (``moved``: from, to, both job ids, why). When the other cluster refuses
   the submission, the run is submitted again where it was (``move_failed``).

So two attempts never train at once: the old job is gone before the new one is queued. The
watcher holds ``RUN/mover.lock`` (one at a time; a killed one's lock goes with its process), writes
``RUN/logs/mover.log``, and ends when the run does (DONE, CANCELLED, or its job ended without a
requeue).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher.context import Context
from launcher.planning import transport
from launcher.planning.clusters import HELD, Answer, Queued, move_due, move_target, plan_each
from launcher.planning.resolve import Resolved, resolve
from launcher.runs import far_copy, registry as runs
from launcher.runs.run_lock import run_lock
from launcher.submit.far_submit import far_run
from launcher.submit.start_estimates import answer_s, ask, describe
from launcher.submit.submission import submit_plan
from lmcore import jsonlines
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.run import rundir
from lmcore.run.checkpoint_index import choose_for_resume
from lmcore.slurm import client as slurm

__all__ = ["HELD", "current_job", "decide", "move", "start_watcher", "watch"]  # HELD: for the command
GONE_WAIT_S = 60.0  # how long a cancelled job may take to leave its cluster's queue
FAR_POLL_S = 30.0  # a run without a move section: how often its copy over SSH is brought back
ENDED_LOOKS = 3  # the run's job unknown to its cluster this many looks in a row: the run ended


def current_job(rec: runs.RunRecord, environ: dict[str, str] | None, now: float | None = None) -> Queued | None:
    """The run's newest job as its cluster lists it now; None when the cluster no longer does."""
    job = rec.last_job_id
    if job is None:
        return None
    prof = rec.profile_of(job)
    with transport.through(transport.job_target(rec, job, environ), exactly=True):
        rows = [q for q in slurm.squeue([job]) if q.job_id == job]
    if not rows:
        return None
    q = rows[0]
    ledger = jsonlines.read_jsonl(rundir.RunLayout.of(rec.run_dir).ledger)
    last = next((e for e in reversed(ledger) if e.get("event") in ("start", "end")), None)
    submitted = rec.submitted_at[-1] if rec.submitted_at else 0.0
    preempted = bool(last and last.get("event") == "end" and last.get("reason") == "preempted" and last.get("requeued")
                     and str(last.get("job_id")) == job and float(last.get("time") or 0) >= submitted)
    since = max([submitted,
                 float(last["time"]) if last and last.get("event") == "end" and last.get("time") else 0.0])
    now = time.time() if now is None else now
    return Queued(prof, job, q.state, q.reason, max(0.0, now - since), preempted)


def _plans(rec: runs.RunRecord, ctx: Context) -> list[Resolved]:
    """The run planned on each of its clusters, from its own resolved spec."""
    layout = rundir.RunLayout.of(rec.run_dir)
    first = resolve(str(layout.spec_yaml), [], None, ctx.environ, python=ctx.python, force=True, several=True)
    if not first.spec.clusters:
        raise UserError(f"run '{rec.name}' names one cluster ({first.profile.name}): there is nowhere to move it",
                        exit_code=2)
    return plan_each(str(layout.spec_yaml), [], first.spec.clusters, ctx.environ, ctx.python, force=True, done=first)


def _here(q: Queued, plans: list[Resolved], bound: float, environ: dict[str, str] | None) -> Answer:
    """The queued job's own start estimate (squeue's StartTime), else a new job's there."""
    with transport.through(transport.run_profile_target(q.cluster, environ), exactly=True):
        rows = [r for r in slurm.squeue([q.job_id]) if r.job_id == q.job_id]
    start = slurm.parse_time(rows[0].start) if rows else None
    if start is not None:
        return Answer(q.cluster, True, start, f"job {q.job_id}'s own start estimate")
    mine = next((p for p in plans if p.profile.name == q.cluster), None)
    return ask(mine, None, bound) if mine is not None else Answer(q.cluster, True, None, "not asked")


def decide(rec: runs.RunRecord, q: Queued, ctx: Context, to: str | None = None) -> tuple[Resolved | None, list[str]]:
    """Where the queued job ``q`` goes (its plan there), or None; with what the clusters said."""
    plans = _plans(rec, ctx)
    bound = answer_s(ctx.environ or None)
    others = [ask(p, None, bound) for p in plans if p.profile.name != q.cluster and (to is None or p.profile.name == to)]
    if to is not None and not others:
        names = ", ".join(p.profile.name for p in plans)
        raise UserError(f"move --to {to}: not one of the run's other clusters ({names})", exit_code=2)
    here = _here(q, plans, bound, ctx.environ or None)
    if to is not None:  # asked for by name: there, whenever it would take the job
        best = others[0] if others[0].answered and others[0].accepted else None
        why = "asked for with --to" if best else f"{to} would not take the job"
    else:
        best, why = move_target(q, here, others)
    lines = describe([here, *others], best, why)
    return (next(p for p in plans if p.profile.name == best.cluster) if best else None), lines


class NothingQueued(UserError):
    """A move cancelled the run's queued job and could queue it neither there nor back: the watcher
    submits it again at its next look (:func:`requeue_lost`)."""


def move(rec: runs.RunRecord, q: Queued, dest: Resolved, why: str, ctx: Context, say: Any) -> str | None:
    """Move the queued job ``q`` to ``dest``'s cluster, under the run's lock (no submit, cancel or
    other move meanwhile); the new job id, or None when the job started, ended or was cancelled
    meanwhile (left alone). Once the old job is cancelled the run is always queued again: there,
    or back where it was, or (:class:`NothingQueued`) by the watcher's next look."""
    env = ctx.environ or None
    layout = rundir.RunLayout.of(rec.run_dir)
    with run_lock(rec.name, env):
        now_rec = runs.load_record(rec.name, env) or rec
        if layout.cancelled.exists() or layout.done.exists() or now_rec.last_job_id != q.job_id:
            say(f"run '{rec.name}' changed meanwhile (cancelled, done or submitted again): not moved")
            return None
        try:
            with transport.through(transport.job_target(now_rec, q.job_id, env), exactly=True):
                if not _hold_and_cancel(q, say, lambda: _copy_for_move(now_rec, q, dest, say)):
                    return None
        except far_copy.CopyFailed as exc:  # released: it waits where it was
            say(f"move to {dest.profile.name} abandoned: {exc.message}; job {q.job_id} stays queued on {q.cluster}")
            _note(layout, "move_abandoned", {"from": q.cluster, "from_job": q.job_id, "to": dest.profile.name,
                                             "why": why, "error": exc.message})
            return None
        say(f"job {q.job_id} on {q.cluster}: held and cancelled while queued ({why})")
        if (source := far_copy.of_record(now_rec, q.job_id)) is not None:
            try:
                far_copy.pull(layout.run_dir, source)  # its ledger's last lines, before the next attempt's
            except far_copy.CopyFailed as exc:  # its checkpoint came already; the submission tries again
                say(f"copying back from {source.where} failed ({exc.message}); submitting anyway")
        out = io.StringIO()
        quiet = Context(stdout=out, stderr=out, environ=ctx.environ, python=ctx.python)
        try:
            submit_plan(dest, quiet, resume=True, spec_path=now_rec.spec_path)
        except (UserError, SlurmUnavailable) as exc:
            say(f"submitting on {dest.profile.name} failed ({exc.message}); submitting again on {q.cluster}")
            job = _back(now_rec, q.cluster, ctx, quiet, say)
            _note(layout, "move_failed", {"from": q.cluster, "from_job": q.job_id, "to": dest.profile.name,
                                          "why": why, "error": exc.message, "job": job})
            say(out.getvalue().rstrip())
            if job is None:
                raise NothingQueued(f"run '{rec.name}' is queued nowhere: its job {q.job_id} was cancelled for a move "
                                    f"that failed ({exc.message}), and so did submitting it again on {q.cluster}") from None
            return None
        job = (runs.load_record(rec.name, env) or now_rec).last_job_id
        _note(layout, "moved", {"from": q.cluster, "from_job": q.job_id, "to": dest.profile.name, "to_job": job,
                                "why": why})
        say(out.getvalue().rstrip())
        return job


def _hold_and_cancel(q: Queued, say: Any, prepare: Any) -> bool:
    """Hold the queued job (it cannot start meanwhile), ``prepare`` the move (a checkpoint copied
    between clusters over SSH), then cancel it and wait until its queue no longer lists it; False
    (and the job released) when it is no longer queued once held. A failure before the cancel
    releases it: it waits where it was, as before."""
    slurm.hold(q.job_id)
    try:
        now = [r for r in slurm.squeue([q.job_id]) if r.job_id == q.job_id]
        if not now or now[0].state != "PENDING":
            say(f"job {q.job_id} on {q.cluster} is {now[0].state if now else 'gone'} now: not moved")
            return False
        prepare()
        slurm.cancel([q.job_id])
    except BaseException:
        with contextlib.suppress(SlurmUnavailable, UserError):
            slurm.hold(q.job_id, release=True)
        raise
    _wait_gone(q.job_id)
    return True


def _copy_for_move(rec: runs.RunRecord, q: Queued, dest: Resolved, say: Any) -> None:
    """While the queued job is held: the run's newest checkpoint brought here from the cluster over
    SSH it waits on, and copied to the cluster over SSH it goes to, each copy checked against its
    manifest (:class:`far_copy.CopyFailed`: the move is abandoned)."""
    run_dir = Path(rec.run_dir)
    if (source := far_copy.of_record(rec, q.job_id)) is not None:
        name = far_copy.pull(run_dir, source, checkpoint=True)
        say(f"copied from {source.where}: its files, and checkpoint {name or '(none yet)'}, checked")
    if dest.profile.login is not None:
        far = far_run(dest.profile, dest.plan)
        chosen = choose_for_resume(dest.plan.paths.checkpoint_dir).chosen
        far_copy.push(run_dir, far, chosen.path if chosen else None)
        say(f"copied to {far.where}: the run directory, and checkpoint {chosen.path.name if chosen else '(none yet)'}, "
            "checked there")


def _back(rec: runs.RunRecord, cluster: str, ctx: Context, quiet: Context, say: Any) -> str | None:
    """The run submitted again on ``cluster`` (where a failed move took it from); its job id, or
    None when that fails too."""
    layout = rundir.RunLayout.of(rec.run_dir)
    try:
        back = resolve(str(layout.spec_yaml), [], cluster, ctx.environ, python=ctx.python, force=True)
        submit_plan(back, quiet, resume=True, spec_path=rec.spec_path)
    except (UserError, SlurmUnavailable) as exc:
        say(f"submitting again on {cluster} failed too ({exc.message})")
        return None
    return (runs.load_record(rec.name, ctx.environ or None) or rec).last_job_id


def requeue_lost(rec: runs.RunRecord, ctx: Context, say: Any) -> bool:
    """After :class:`NothingQueued`: the run submitted again where its last job was; True when queued."""
    out = io.StringIO()
    quiet = Context(stdout=out, stderr=out, environ=ctx.environ, python=ctx.python)
    with run_lock(rec.name, ctx.environ or None):
        job = _back(rec, rec.profile_of(rec.last_job_id or ""), ctx, quiet, say)
    if job is not None:
        say(f"queued again: job {job}")
    return job is not None


def _wait_gone(job_id: str) -> None:
    deadline = time.monotonic() + GONE_WAIT_S
    while [r for r in slurm.squeue([job_id]) if r.job_id == job_id and slurm.is_active(r.state)]:
        if time.monotonic() > deadline:
            raise UserError(f"job {job_id} was cancelled but is still listed after {GONE_WAIT_S:.0f} s: not moved",
                            exit_code=1)
        time.sleep(1.0)


def _note(layout: rundir.RunLayout, event: str, fields: dict[str, Any]) -> None:
    rundir.Ledger(layout.ledger).write(rundir.LedgerNote(event=event, time=time.time(), fields=fields))


# --------------------------------------------------------------------------- the watcher

def watch(rec: runs.RunRecord, ctx: Context) -> int:
    """Watch the run until it ends, moving its queued job when a move is due (one watcher per run)."""
    layout = rundir.RunLayout.of(rec.run_dir)
    lock = open(layout.mover_lock, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        ctx.out(f"run '{rec.name}': a watcher already runs (it holds {layout.mover_lock})")
        return 0
    plans = _plans(rec, ctx)
    move_spec = plans[0].spec.move
    over_ssh = [p.profile.name for p in plans if p.profile.login is not None]
    if move_spec is None and not over_ssh:
        raise UserError(f"run '{rec.name}' has no move section: it stays where it was placed", exit_code=2)
    poll_s = move_spec.poll_s if move_spec is not None else FAR_POLL_S

    def say(text: str) -> None:
        ctx.out(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}")
        ctx.stdout.flush()

    say(f"watching run '{rec.name}' (" + (f"move.after {move_spec.after}, on_preemption {move_spec.on_preemption}, "
        if move_spec is not None else "no move section: ") + (f"its copies on {', '.join(over_ssh)} kept in step, "
        if over_ssh else "") + f"every {poll_s} s)")
    misses, said, lost = 0, "", False
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
            lost = not requeue_lost(rec, ctx, say)
            time.sleep(poll_s)
            continue
        try:
            q = current_job(rec, ctx.environ or None)
        except (SlurmUnavailable, UserError) as exc:
            say(f"its cluster did not answer ({exc.message}); trying again")
            time.sleep(poll_s)
            continue
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
            except NothingQueued as exc:
                say(exc.message)
                lost = True
            except (SlurmUnavailable, UserError) as exc:  # a cluster or a plan that fails now: said, tried again
                say(f"no move now: {exc.message}")
        time.sleep(poll_s)


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
    dest, lines = decide(rec, q, ctx)
    if "\n".join(lines) != said:
        for line in lines:
            say(line)
        said = "\n".join(lines)
    if dest is not None:
        job = move(rec, q, dest, why, ctx, say)
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
