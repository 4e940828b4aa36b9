"""lmlaunch logs RUN [-f] [--rank N] [--attempt K] [--errors] [--json]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.commands import with_examples
from launcher.context import Context
from launcher.monitor import run_files
from launcher.monitor.logs import finished_check, print_logs
from launcher.runs import far_copy, registry as runs
from lmcore.errors import UserError
from lmcore.run import rundir


def add_arguments(p: argparse.ArgumentParser) -> None:
    with_examples(
        p,
        'lmlaunch logs tiny-cpu -f',
        'lmlaunch logs tiny-cpu --rank 1 --attempt 2',
        'lmlaunch logs tiny-cpu --errors',
    )
    p.add_argument("run", help="a run name, one of its job ids, or a run directory (local runs)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output and new attempts until the run ends")
    p.add_argument("--rank", type=int, default=0, help="global rank whose log to show (default 0)")
    p.add_argument("--attempt", type=int, default=None, help="only this attempt (1-based)")
    p.add_argument("--errors", action="store_true",
                   help="only tracebacks and error lines (the evaluator's too, for a run with eval.alongside)")
    p.add_argument("--evaluator", action="store_true",
                   help="the evaluator's log of each job instead of a rank's (eval.alongside)")
    p.add_argument("--json", action="store_true", help="the log files (attempt, path, size) as JSON, no content")
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace, ctx: Context) -> int:
    rec = runs.find_run(args.run, ctx.environ or None)
    if (trouble := far_copy.refresh(rec)) is not None:
        ctx.err(f"note: {trouble}: shown as last copied")
    run_dir = Path(rec.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run '{rec.name}': its run directory {run_dir} does not exist", exit_code=1)
    world = run_files.read_world_size(run_dir)
    if (world is not None and not 0 <= args.rank < world and not args.evaluator
            and not run_files.log_sources(run_dir, rec.job_ids, rank=args.rank, attempt=args.attempt)):
        raise UserError(f"--rank {args.rank}: run '{rec.name}' has ranks 0 to {world - 1} (world_size {world})")
    if args.attempt is not None:
        known = [n for n, _ in run_files.attempt_dirs(run_dir)]
        if known and args.attempt not in known:
            raise UserError(f"--attempt {args.attempt}: run '{rec.name}' has attempts {', '.join(map(str, known))}")
    if args.json:
        srcs = run_files.evaluator_sources(run_dir, rec.job_ids) if args.evaluator else \
            run_files.log_sources(run_dir, rec.job_ids, rank=args.rank, attempt=args.attempt)
        ctx.out(json.dumps([
            {"attempt": s.attempt, "job_id": s.job_id, "label": s.label, "path": str(s.path),
             "bytes": s.path.stat().st_size, "rank": s.rank} for s in srcs
        ], indent=2))
        return 0
    n = print_logs(
        run_dir, rec.job_ids, ctx.stdout, rank=args.rank, attempt=args.attempt, errors=args.errors,
        follow=args.follow, finished=finished_check(run_dir, rec.job_ids), interval=args.interval,
        evaluator=args.evaluator,
    )
    if n == 0 and not args.follow:
        ctx.err(f"run '{rec.name}': no logs yet for rank {args.rank} (looked in {rundir.RunLayout.of(run_dir).logs} and "
                f"{rundir.RunLayout.of(run_dir).submitit}); the job may still be queued: `lmlaunch status {rec.name}`")
    return 0
