"""lmlaunch profile RUN [--steps N] [--ranks R,...] [--json]: torch.profiler over a running job's next steps.

The request is a file in the run directory (``profile-request.json``, written atomically) that
the ranks poll at their logging steps (lmtrain.observe.profiling): no signal, no SLURM call
into the job. Each rank asked profiles its next N optimizer steps and writes a Chrome/Perfetto
trace and its top operators by self time into ``logs/attempt-<N>/profile-<id>/``; this command
waits for every asked rank's table (while the job runs) and prints them side by side.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from pathlib import Path
from typing import Any

from launcher.context import Context
from launcher.monitor.profile_tables import MAX_STEPS, parse_ranks, side_by_side
from launcher.runs import registry as runs
from lmcore import jsonlines
from lmcore.atomic import write_json
from lmcore.errors import ExitCode, UserError
from lmcore.run import rundir
from lmcore.slurm import client as slurm

POLL_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name or one of its job ids (the job must be running)")
    p.add_argument("--steps", type=int, default=3, help="how many optimizer steps to profile (default 3)")
    p.add_argument("--ranks", default=None, help="global ranks, e.g. 0,1 (default: every rank)")
    p.add_argument("--top", type=int, default=15, help="operators shown per rank (default 15)")
    p.add_argument("--json", action="store_true", help="every rank's table as JSON")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the tables while the job runs (default 600)")


def _world_size(run_dir: Path) -> int:
    try:
        return int(json.loads(rundir.RunLayout.of(run_dir).plan.read_text())["topology"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{run_dir}: no readable plan.json (not an lmlaunch run directory?)") from None


def _running(name: str, job_ids: list[str]) -> tuple[str, int]:
    """The run's job and its restart count, which must be RUNNING; else a UserError saying its state."""
    if not job_ids:
        raise UserError(f"run '{name}' has no SLURM job (a local run, or never submitted): `lmlaunch profile` "
                        "asks a running SLURM job")
    job_id = job_ids[-1]
    rows = slurm.squeue([job_id])
    job = next((j for j in rows if j.job_id == job_id), rows[0] if len(rows) == 1 else None)
    if job is not None and slurm.state_word(job.state) == "RUNNING":
        return job_id, int(getattr(job, "restarts", 0) or 0)
    state = job.state if job is not None else "no longer listed by squeue (it ended)"
    raise UserError(f"run '{name}' is not running: its job {job_id} is {state}; `lmlaunch profile` profiles the "
                    f"next steps of a running job (`lmlaunch status {name}`)")


def _attempt(run_dir: Path, job_id: str, restarts: int) -> int:
    """The attempt the running job's tasks run: the ledger's start line of this job and restart."""
    starts = [e for e in jsonlines.read_jsonl(rundir.RunLayout.of(run_dir).ledger)
              if e.get("event") == "start" and str(e.get("job_id")) == job_id and e.get("restart_count", 0) == restarts]
    if not starts:
        raise UserError(f"{run_dir}: job {job_id} runs but this start of it has not begun training yet; try again "
                        "in a moment")
    return int(starts[-1]["attempt"])


def run(args: argparse.Namespace, ctx: Context) -> int:
    if not 1 <= args.steps <= MAX_STEPS:
        raise UserError(f"--steps {args.steps}: profile 1 to {MAX_STEPS} steps (the ranks asked export the trace "
                        "inside a step, while the others wait)")
    if args.top < 1:
        raise UserError(f"--top {args.top}: show at least 1 operator")
    rec = runs.find_run(args.run, ctx.environ or None)
    run_dir = Path(rec.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run '{rec.name}': its run directory {run_dir} does not exist", exit_code=ExitCode.FAILURE)
    ranks = parse_ranks(args.ranks, _world_size(run_dir))
    job_id, restarts = _running(rec.name, list(rec.job_ids))
    attempt = _attempt(run_dir, job_id, restarts)
    layout = rundir.RunLayout.of(run_dir)
    request_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)  # two in one second differ
    write_json(layout.profile_request, {"id": request_id, "attempt": attempt, "steps": args.steps, "ranks": ranks,
                                        "time": time.time()})
    if not args.json:
        ctx.out(f"asked run '{rec.name}' (job {job_id}, attempt {attempt}) to profile its next {args.steps} step(s) on "
                f"{'every rank' if ranks is None else 'rank ' + ','.join(map(str, ranks))}; waiting for the tables")
    out_dir = layout.profile_dir(attempt, request_id)
    tables = _wait(out_dir, ranks, _world_size(run_dir), job_id, rec.name, args.timeout)
    if args.json:
        ctx.out(json.dumps({"id": request_id, "dir": str(out_dir), "ranks": tables}))
        return 0
    ctx.out(side_by_side(tables, args.top))
    ctx.out(f"traces (open in https://ui.perfetto.dev or chrome://tracing): {out_dir}/trace-rank-<R>.json")
    return 0


def _wait(out_dir: Path, ranks: list[int] | None, world: int, job_id: str, name: str,
          timeout_s: float) -> list[dict[str, Any]]:
    """Every asked rank's table, once all are written; a UserError when the job ends first or the
    tables do not come within ``timeout_s`` (a rank whose profiler could not start says why in its log)."""
    wanted = list(range(world)) if ranks is None else ranks
    give_up = time.monotonic() + timeout_s
    while True:
        tables = []
        for r in wanted:
            try:
                tables.append(json.loads((out_dir / f"top-rank-{r}.json").read_text()))
            except (OSError, ValueError):
                break
        if len(tables) == len(wanted):
            return tables
        rows = slurm.squeue([job_id])
        if not any(slurm.state_word(j.state) == "RUNNING" for j in rows):
            got = ", ".join(str(t["rank"]) for t in tables) or "none"
            raise UserError(f"run '{name}': its job {job_id} stopped running before every asked rank wrote its "
                            f"profile (written: {got}; {out_dir})", exit_code=ExitCode.FAILURE)
        if time.monotonic() > give_up:
            got = ", ".join(str(t["rank"]) for t in tables) or "none"
            raise UserError(f"run '{name}': not every asked rank wrote its profile within {timeout_s:.0f} s (written: "
                            f"{got}; {out_dir}); the rank logs say why (`lmlaunch logs {name} --rank R`)",
                            exit_code=ExitCode.FAILURE)
        time.sleep(POLL_S)


