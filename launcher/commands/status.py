"""lmlaunch status [RUN|JOBID] [--watch] [--json] [--all]"""

from __future__ import annotations

import argparse
import json
import time

from launcher.commands import with_examples
from launcher.context import Context
from launcher.monitor import slurm_view, status_rows as monitor, sweep_rows
from launcher.monitor.view import make_console, status_text, status_view
from launcher.runs import registry as runs
from lmcore.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    with_examples(
        p,
        'lmlaunch status',
        'lmlaunch status tiny-cpu --watch           # ends when the run ends',
        'lmlaunch status --all --json',
    )
    p.add_argument("run", nargs="?", help="a run name or one of its job ids (default: all runs)")
    p.add_argument("--watch", "-w", action="store_true",
                   help="refresh in place until Ctrl-C; `status RUN --watch` ends when the run has ended")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    p.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # --watch: stop after N refreshes (tests)
    p.add_argument("--json", action="store_true", help="rows as JSON (for scripts)")
    p.add_argument("--all", "-a", action="store_true", help="also runs that ended more than a day ago")


def _collect(args: argparse.Namespace, ctx: Context):
    env = ctx.environ or None
    points = runs.sweep_records(args.run, env) if args.run else []
    now = time.time()
    hidden = 0
    if args.run and points and runs.load_record(args.run, env) is None:
        records = points  # `status SWEEP`: its points
    elif args.run:
        records = [runs.find_run(args.run, env)]
    elif args.all:
        records = runs.list_records(env)
    else:  # old runs whose jobs ended for good are not even read
        records, hidden = runs.recent_or_unfinished(slurm_view.ended_jobs(env), now, environ=env)
    rows, view = monitor.gather_status(records, environ=env, now=now)
    if not args.run and not args.all:
        keep = [monitor.is_recent_or_active(r, rec, now) for r, rec in zip(rows, records)]
        hidden += keep.count(False)
        rows, records = [r for r, k in zip(rows, keep) if k], [rec for rec, k in zip(records, keep) if k]
    if not args.run:
        rows = sweep_rows.collapse(rows, records)  # a sweep is one row; `status SWEEP` lists its points
    return rows, view, hidden, now


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.interval <= 0:

        raise UserError(f"--interval must be a positive number of seconds, got {args.interval}")
    rows, view, hidden, now = _collect(args, ctx)
    if args.json:
        ctx.out(json.dumps({
            "slurm": {"reachable": view.reachable, "message": view.message, "calls": view.calls, "via": _via()},
            "hidden": hidden,
            "runs": [r.to_dict() for r in rows],
        }, indent=2 if getattr(ctx.stdout, "isatty", lambda: False)() else None))
        return 0

    if not args.watch:

        color = getattr(ctx.stdout, "isatty", lambda: False)() and "NO_COLOR" not in ctx.environ
        ctx.out(status_text(rows, view, hidden=hidden, color=color))
        return 0
    from rich.live import Live


    console = make_console(ctx)

    n = 1
    with Live(status_view(rows, view, hidden=hidden, now=now), console=console, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        while (args.count is None or n < args.count) and not _ended(args, rows):
            time.sleep(args.interval)
            rows, view, hidden, now = _collect(args, ctx)
            live.update(status_view(rows, view, hidden=hidden, now=now), refresh=True)
            n += 1
    return 0


def _ended(args: argparse.Namespace, rows: list[monitor.StatusRow]) -> bool:
    """`status RUN --watch`: the run (a sweep: each of its points) is neither queued nor running,
    and SLURM answered; the list of every run is watched until Ctrl-C."""
    return bool(args.run) and bool(rows) and all(r.group not in ("queued", "running", "unknown") for r in rows)


def _via() -> str:
    """How SLURM was asked: its commands here, or the slurmrestd at URL (launcher.planning.transport)."""
    from lmcore.slurm.way import way

    return way().described
