"""lmlaunch preempt RUN [--mode signal|term|requeue|node-failure] [--start-now] [--json]

Rehearse what a real cluster does to a running job, on a real SLURM (launcher.submit.rehearsal
does it; every SLURM call goes through lmcore.slurm):

- ``signal``: the warning signal of the run's plan (``preemption.signal``, e.g. USR2) to every
  task of every step, as SLURM sends it before the time limit (``--signal`` without ``B:``);
- ``term``: SIGTERM to every task, as preemption without ``preempt_send_user_signal`` sends it;
  the job is not requeued by SLURM, so the runtime decides (it requeues itself unless the run
  was cancelled);
- ``requeue`` (default): a real preemption: an ``--exclusive`` job on the profile's
  high-priority partition over the job's nodes; SLURM signals, requeues the victim, and the
  preemptor is cancelled as soon as the victim is requeued;
- ``node-failure``: one node the job's ranks run on is drained and set DOWN (SLURM kills the job
  and requeues it as a node failure; a job with spare nodes restarts its ranks in place on a
  spare), then RESUMEd once the job's tasks are gone from it, always, even when waiting fails.

``--start-now`` lets a requeued job start at once instead of after SLURM's ~2 min BeginTime
delay. The command prints what it did and how long SLURM took; ``--json`` prints it as JSON.
"""

from __future__ import annotations

import argparse
import json

from launcher.context import Context
from launcher.runs import registry as runs
from launcher.submit.rehearsal import MODES, preempt, running_job
from lmcore.errors import ExitCode, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name or one of its job ids")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="requeue",
        help="signal: the plan's warning signal; term: SIGTERM; requeue: a preempting high-priority "
        "exclusive job (default); node-failure: set one of the job's nodes DOWN, then RESUME",
    )
    p.add_argument("--node", help="node-failure: the node to set DOWN (default: the last node the job's ranks run on)")
    p.add_argument("--partition", help="requeue: the partition of the preempting job (default: the profile's high-priority one)")
    p.add_argument("--start-now", action="store_true", help="start the requeued job at once (skip SLURM's BeginTime delay)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for SLURM to requeue the job (default 180)")
    p.add_argument("--json", action="store_true", help="print what was done as JSON")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.timeout <= 0:
        raise UserError(f"--timeout must be > 0, got {args.timeout}")
    rec = runs.find_run(args.run, ctx.environ or None)
    victim = running_job(rec)
    result = preempt(victim, args.mode, node=args.node, partition=args.partition, timeout=args.timeout,
                     start_now=args.start_now, environ=ctx.environ or None)
    if args.json:
        ctx.out(json.dumps(result, indent=2))
    else:
        ctx.out(_describe(result))
    if args.mode in ("requeue", "node-failure") and not (result.get("requeued") or result.get("restarted_in_place")):
        return ExitCode.FAILURE
    return 0


def _describe(r: dict) -> str:
    job = f"job {r['job_id']} of run '{r['run']}'"
    if r["mode"] in ("signal", "term"):
        return f"sent SIG{r['signal']} to every task of {job} on {', '.join(r['nodes'])}"
    how = (
        f"preempting job {r['preemptor_job_id']} on partition {r['partition']} (cancelled again)"
        if r["mode"] == "requeue"
        else f"node {r['node']} set DOWN, then RESUMEd"
    )
    if r.get("restarted_in_place"):
        out = ",".join(r.get("left_out") or []) or "-"
        tail = (f"; its ranks restarted in place after {r['requeue_seconds']:.1f} s (attempt {r.get('attempt')} "
                f"ended; the same job, nodes left out: {out})")
    elif r.get("requeued"):
        tail = f"; SLURM requeued it after {r['requeue_seconds']:.1f} s (restart {r['restarts']})"
        if r.get("started_now"):
            tail += "; started again at once"
        elif r.get("started_now") is None:
            tail += "; it starts after SLURM's BeginTime delay (~2 min), or pass --start-now"
    else:
        tail = f"; it was not requeued: it ended {r['state']}"
    return f"{job}: {how}{tail}"
