"""Moving a run over several clusters (the spec's ``clusters`` and ``move``): one move, which the
run's watcher (launcher.submit.watcher, `lmlaunch move RUN --watch`) makes when one is due.

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

So two attempts never train at once: the old job is gone before the new one is queued.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

from launcher.context import Context
from launcher.planning import transport
from launcher.planning.clusters import HELD, Answer, Queued, move_target, plan_each
from launcher.planning.resolve import Resolved, resolve
from launcher.runs import far_copy, registry as runs, shared_bucket
from launcher.runs.run_lock import run_lock
from launcher.submit.far_submit import far_run
from launcher.submit.start_estimates import answer_s, ask, describe
from launcher.submit.submission import submit_plan
from lmcore import jsonlines
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.run import rundir
from lmcore.run.checkpoint_index import choose_for_resume
from lmcore.slurm import client as slurm

__all__ = ["HELD", "NothingQueued", "current_job", "decide", "move", "plans_of", "requeue_lost"]  # HELD: for the command
GONE_WAIT_S = 60.0  # how long a cancelled job may take to leave its cluster's queue


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


def plans_of(rec: runs.RunRecord, ctx: Context, one: bool = False) -> list[Resolved]:
    """The run planned on each of its clusters, from its own resolved spec (``one``: a run on one
    cluster is its one plan, not an error)."""
    layout = rundir.RunLayout.of(rec.run_dir)
    first = resolve(str(layout.spec_yaml), [], None, ctx.environ, python=ctx.python, force=True, several=True)
    if not first.spec.clusters and one:
        return [first]
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
    plans = plans_of(rec, ctx)
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
        done: list[str] = []  # what was done with the checkpoint
        try:
            with transport.through(transport.job_target(now_rec, q.job_id, env), exactly=True):
                if not _hold_and_cancel(q, say, lambda: done.append(_copy_for_move(now_rec, q, dest, say))):
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
                                "why": why, "checkpoint": done[-1] if done else None})
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


def _copy_for_move(rec: runs.RunRecord, q: Queued, dest: Resolved, say: Any) -> str:
    """While the queued job is held: the run's newest checkpoint brought here from the cluster over
    SSH it waits on, and copied to the cluster over SSH it goes to, each copy checked against its
    manifest (:class:`far_copy.CopyFailed`: the move is abandoned); none of it when the run's bucket,
    which every cluster reads, holds that checkpoint (launcher.runs.shared_bucket). What was done
    with the checkpoint, for the ledger."""
    run_dir = Path(rec.run_dir)
    source = far_copy.of_record(rec, q.job_id)
    if source is None and dest.profile.login is None:
        return "on the run directory both clusters share"
    newest = far_copy.newest_there(source) if source is not None else far_copy.newest(Path(dest.plan.paths.checkpoint_dir))
    bucket = shared_bucket.holds_newest(run_dir, dest.plan, newest)
    if bucket.said:
        say(bucket.said)
    copy, name = bucket.name is None, None
    if source is not None:
        name = far_copy.pull(run_dir, source, checkpoint=copy)
        say(f"copied from {source.where}: its files" + (f", and checkpoint {name or '(none yet)'}, checked" if copy else ""))
    if dest.profile.login is not None:
        far = far_run(dest.profile, dest.plan)
        chosen = choose_for_resume(dest.plan.paths.checkpoint_dir).chosen if copy else None
        far_copy.push(run_dir, far, chosen.path if chosen else None)
        name = chosen.path.name if chosen else name
        say(f"copied to {far.where}: the run directory" + (
            f", and checkpoint {chosen.path.name if chosen else '(none yet)'}, checked there" if copy else ""))
    return bucket.said if not copy else f"checkpoint {name or '(none yet)'} copied over ssh, checked"


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
