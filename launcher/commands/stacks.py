"""lmlaunch stacks RUN [--native] [--json]: the live Python stack of every task of a running job.

The tasks recorded their node and pid when they started (lmcore.run.task_records); one srun
step beside the job's own (``--overlap``, one task per node) runs ``py-spy dump`` on each of
them (launcher.submit.stacks). A rank whose dump fails shows why in its section; the others still
show, and the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.context import Context
from launcher.runs import registry as runs
from launcher.submit import stacks
from lmcore import jsonlines
from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.run import rundir
from lmcore.run.task_records import read_task_records, recorded_starts
from lmcore.slurm import client as slurm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name or one of its job ids (the job must be running)")
    p.add_argument("--native", action="store_true", help="native (C/C++) frames too, interleaved with Python's")
    p.add_argument("--json", action="store_true", help="a list of {rank, node, pid, stack, error}")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the srun step (default 60)")


def _plan_world_size(run_dir: Path) -> int:
    try:
        return int(json.loads(rundir.RunLayout.of(run_dir).plan.read_text())["topology"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # unknown: the recorded ranks are all there is


def _running_job(name: str, run_dir: Path, job_ids: list[str]) -> tuple[str, slurm.QueuedJob]:
    """The run's current job (as the run and its tasks name it, and as squeue has it: an array
    task ``A_T`` is a job of its own id there, the one srun takes), which must be RUNNING;
    otherwise a UserError saying its state."""
    job_id = job_ids[-1] if job_ids else next((j for j, _ in recorded_starts(run_dir)), None)
    if job_id is None:
        raise UserError(f"run '{name}' has no SLURM job (a local run, or never submitted): "
                        "`lmlaunch stacks` dumps the tasks of a running SLURM job")
    if job_id.startswith("local-"):  # lmtrain.distributed.task_env: a `run --local` process has no SLURM job id
        records, _ = read_task_records(run_dir, job_id, 0)
        pids = ", ".join(f"rank {r.rank}: pid {r.pid}" for r in records) or "none recorded"
        raise UserError(f"run '{name}' runs locally (`lmlaunch run --local`), not under SLURM: dump its processes "
                        f"on this machine with `py-spy dump --pid PID` ({pids})")
    rows = slurm.squeue([job_id])
    job = rows[0] if len(rows) == 1 else next((j for j in rows if j.job_id == job_id), None)
    if job is not None and slurm.state_word(job.state) == "RUNNING":
        return job_id, job
    if job is not None:
        state = job.state + (f" ({job.reason})" if job.reason not in ("", "None") else "")
    else:
        try:
            acct = slurm.sacct([job_id])
            state = f"ended {acct[-1].state}" if acct else "unknown to SLURM (ended long ago)"
        except (UserError, SlurmUnavailable):
            state = "no longer listed by squeue (it ended)"
    raise UserError(f"run '{name}' is not running: its job {job_id} is {state}; `lmlaunch stacks` needs a "
                    f"running job (`lmlaunch status {name}`, `lmlaunch logs {name}`)")


def _attempt_of(run_dir: Path, job_id: str, restarts: int) -> int | None:
    starts = [e for e in jsonlines.read_jsonl(rundir.RunLayout.of(run_dir).ledger)
              if e.get("event") == "start" and e.get("job_id") == job_id and e.get("restart_count") == restarts]
    return starts[-1].get("attempt") if starts else None


def run(args: argparse.Namespace, ctx: Context) -> int:
    rec = runs.find_run(args.run, ctx.environ or None)
    run_dir = Path(rec.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run '{rec.name}': its run directory {run_dir} does not exist", exit_code=ExitCode.FAILURE)
    job_ref, job = _running_job(rec.name, run_dir, list(rec.job_ids))
    records, problems = read_task_records(run_dir, job_ref, job.restarts)
    for p in problems:
        ctx.err(f"warning: unreadable task record {p}")
    if not records:
        raise UserError(
            f"run '{rec.name}': job {job_ref} runs (restart {job.restarts}) but none of its tasks has recorded "
            f"its pid yet under {rundir.RunLayout.of(run_dir).task_records}; it may still be starting: try again in a few "
            "seconds", exit_code=ExitCode.FAILURE)
    script = stacks.node_script(records, native=args.native, dump_timeout_s=max(5, int(args.timeout) - 10))
    nodes = sorted({r.node for r in records})
    step = slurm.run_overlap_step(job.job_id, nodes, ["bash", "-c", script], timeout=args.timeout)
    step_error = None
    if step.returncode != 0:
        step_error = " ".join(step.stderr.split())[-600:] or f"srun exit status {step.returncode}"
    sections = stacks.assemble(records, _plan_world_size(run_dir), step.stdout, step_error=step_error)
    if args.json:
        ctx.out(json.dumps([s.to_json() for s in sections], indent=2))
    else:
        attempt = _attempt_of(run_dir, job_ref, job.restarts)
        where = f"attempt {attempt}, " if attempt is not None else ""
        ctx.out(f"run '{rec.name}' · {where}job {job_ref} on {job.nodelist} · "
                f"{'Python and native' if args.native else 'Python'} stacks, most recent call first\n")
        ctx.out(stacks.format_sections(sections))
    for s in sections:
        if s.note:
            ctx.err(f"warning: rank {s.rank}: {s.note}")
    failed = [s.rank for s in sections if s.error is not None]
    if failed:
        ctx.err(f"no stack for rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}: see "
                f"{'their sections' if len(failed) > 1 else 'its section'}")
        return ExitCode.FAILURE
    return ExitCode.OK
