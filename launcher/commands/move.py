"""lmlaunch move RUN [--to CLUSTER] [--dry-run] | --watch | --detach: a run over several clusters
(the spec's clusters) moved where it starts sooner, while its job waits in a queue; the run's watcher
(--watch), which also requeues a run with spare nodes whose batch script's node failed."""

from __future__ import annotations

import argparse

from launcher.context import Context
from launcher.runs import registry as runs
from lmcore.errors import UserError
from lmcore.run import rundir
from lmcore.slurm import client as slurm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name or one of its job ids")
    p.add_argument("--to", metavar="CLUSTER",
                   help="move it to this one of its clusters whenever that one would take it (default: where it "
                        "starts more than a minute sooner, if any)")
    p.add_argument("--dry-run", action="store_true", help="ask the clusters and say what would be done; change nothing")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--watch", action="store_true",
                   help="keep watching the run until it ends: move it as its spec's move section says, and "
                        "requeue it if it has spare nodes and its batch script's node fails (submit starts one in "
                        "the background)")
    g.add_argument("--detach", action="store_true", help="--watch in the background (writes RUN/logs/mover.log)")


def run(args: argparse.Namespace, ctx: Context) -> int:
    from launcher.submit import mover, watcher

    rec = runs.find_run(args.run, ctx.environ or None)
    if args.detach:
        pid = watcher.start_watcher(rec.name, rec.run_dir, ctx)
        ctx.out(f"run '{rec.name}': watcher started in the background (pid {pid}); it writes "
                f"{rundir.RunLayout.of(rec.run_dir).mover_log}")
        return 0
    if args.watch:
        return watcher.watch(rec, ctx)
    q = mover.current_job(rec, ctx.environ or None)
    if q is None or q.state != "PENDING":
        raise UserError(f"run '{rec.name}': its job {rec.last_job_id} on {rec.profile_of(rec.last_job_id or '')} is "
                        f"{q.state if q else 'no longer queued'}: only a queued job moves (a running one: "
                        "`lmlaunch cancel` it, then `lmlaunch submit SPEC --resume --cluster CLUSTER`)", exit_code=2)
    if q.reason in mover.HELD:
        raise UserError(f"run '{rec.name}': job {q.job_id} is held ({q.reason}): release it first "
                        "(scontrol release), or cancel it", exit_code=2)
    dest, lines = mover.decide(rec, q, ctx, to=args.to)
    for line in lines:
        ctx.out(line)
    if dest is None or args.dry_run:
        return 0 if args.dry_run else 1
    job = mover.move(rec, q, dest, f"lmlaunch move by {slurm.user_name()}", ctx, ctx.out)
    if job is None:
        return 1
    ctx.out(f"moved run '{rec.name}' to {dest.profile.name}: job {job} (job {q.job_id} on {q.cluster} cancelled)")
    return 0
