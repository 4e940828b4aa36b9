"""lmlaunch cancel RUN [--json]: mark the run CANCELLED (never requeued), then scancel its jobs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from launcher.context import Context
from launcher.planning import transport
from launcher.runs import far_copy, registry as runs
from launcher.runs.run_lock import run_lock
from launcher.submit import lifecycle
from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.run import rundir
from lmcore.slurm import client as slurm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name or one of its job ids")
    p.add_argument("--json", action="store_true", help="what was done, as JSON")


def cancel_run(rec, environ=None) -> dict:
    """The order matters: the CANCELLED marker is on disk BEFORE scancel's SIGTERM reaches the
    tasks, so the runtime reads it as a user cancel and never requeues. Under the run's lock: a
    move between clusters in progress finishes first, and its new job is cancelled too."""
    with run_lock(rec.name, environ):
        return _cancel_run(runs.load_record(rec.name, environ) or rec, environ)


def _cancel_run(rec, environ=None) -> dict:
    run_dir = Path(rec.run_dir)
    now = time.time()
    user = slurm.user_name()
    marker = rundir.RunLayout.of(run_dir).cancelled
    if run_dir.is_dir():
        lifecycle.mark_cancelled(run_dir, user=user, job_ids=list(rec.job_ids), now=now)

    active: list[str] = []
    problems: list[str] = []
    for prof, ids in rec.jobs_by_profile().items():  # each cluster on its own: one that does not answer stops no other
        try:
            with transport.through(transport.job_target(rec, ids[-1], environ), exactly=True):
                live = [j.job_id for j in slurm.active_jobs(ids)]
                if live:
                    if run_dir.is_dir():  # a copy over SSH: its ranks read the marker there
                        try:
                            far_copy.put_marker(rec, live[-1], rundir.CANCELLED)
                        except far_copy.CopyFailed as exc:  # cancelled all the same: it would train on
                            problems.append(f"{prof}: {exc.message}; its ranks may requeue it once")
                    slurm.cancel(live)
            active += live
        except (SlurmUnavailable, UserError) as exc:
            problems.append(f"{prof}: {exc.message}" if len(rec.jobs_by_profile()) > 1 else exc.message)
    message = "" if not problems else (f"SLURM unreachable, nothing was scancelled: {'; '.join(problems)}" if not active
                                       else f"SLURM unreachable there, its jobs not scancelled: {'; '.join(problems)}")
    rec.state = "cancelled"
    runs.save_record(rec, environ)
    if run_dir.is_dir():
        lifecycle.note_cancel(run_dir, user=user, job_ids=active or list(rec.job_ids[-1:]), now=now)
    return {"name": rec.name, "cancelled_jobs": active, "marker": str(marker), "message": message}


def run(args: argparse.Namespace, ctx: Context) -> int:
    from launcher.search import plan as search_plan

    search = search_plan.mark_cancelled(args.run, ctx)  # a search's driver stops asking first
    points = runs.sweep_records(args.run, ctx.environ or None)
    if search is not None and not points:
        ctx.out(f"cancelled search '{args.run}' before any trial was submitted (marker {search})")
        return 0
    if points and runs.load_record(args.run, ctx.environ or None) is None:  # a sweep: every point
        results = [cancel_run(r, ctx.environ or None) for r in points]
        if args.json:
            ctx.out(json.dumps({"sweep": args.run, "points": results}, indent=2))
        else:
            jobs = [j for r in results for j in r["cancelled_jobs"]]
            ctx.out(f"cancelled sweep '{args.run}': {len(points)} points marked CANCELLED"
                    + (f", scancel {' '.join(jobs)}" if jobs else ""))
        return 0
    rec = runs.find_run(args.run, ctx.environ or None)
    result = cancel_run(rec, ctx.environ or None)
    if args.json:
        ctx.out(json.dumps(result, indent=2))
    else:
        if result["cancelled_jobs"]:
            ctx.out(f"cancelled run '{rec.name}': scancel {' '.join(result['cancelled_jobs'])}")
        elif not result["message"]:
            ctx.out(f"run '{rec.name}' had no queued or running job; marked cancelled")
        ctx.out(f"marker {result['marker']}: the run will not be requeued")
    if result["message"]:
        ctx.err(result["message"])
        return ExitCode.UNAVAILABLE
    return 0
