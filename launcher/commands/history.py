"""lmlaunch history RUN [--json] [--timing]: the attempts ledger with goodput, steps lost and queue
wait; with --timing where each attempt spent its startup."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.context import Context
from launcher.monitor import eval_rows, history_rows, slurm_view
from launcher.monitor.view import history_view, make_console, startup_view
from launcher.runs import far_copy, registry as runs
from lmcore import jsonlines
from lmcore.run import eval_alongside, rundir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name, one of its job ids, or a run directory (local runs)")
    p.add_argument("--json", action="store_true", help="the attempts as JSON")
    p.add_argument("--timing", action="store_true",
                   help="where each attempt spent the time from its allocation to its first step")


def load_history(rec):
    """The ledger, the whole heartbeat (for training time per attempt), ONE `sacct -D` call, and the
    evaluator's scores (eval.alongside)."""
    run_dir = Path(rec.run_dir)
    layout = rundir.RunLayout.of(run_dir)
    ledger = jsonlines.read_jsonl(layout.ledger)
    heartbeat = jsonlines.read_jsonl(layout.heartbeat)
    times, message = _attempt_times(rec)
    h = history_rows.build_history(rec.name, ledger, heartbeat, times)
    if message:
        h.notes.append(f"queue wait unknown: {message}")
    if len(rec.jobs_by_profile()) > 1:  # a run whose jobs went to several clusters: each attempt's
        for row in h.attempts:
            row.cluster = attempt_cluster(rec, row.profile, row.job_id)
    try:
        plan = json.loads(layout.plan.read_text())
    except (OSError, ValueError):
        plan = None
    if isinstance(plan, dict) and isinstance(plan.get("memory"), dict):
        world = (plan.get("topology") or {}).get("world_size")
        h.planned_memory = plan["memory"]
        h.notes.extend(history_rows.memory_notes(h, plan["memory"], world if isinstance(world, int) else None))
    h.notes.extend(history_rows.container_notes(rundir.environment_records(run_dir)))
    h.notes.extend(history_rows.unstarted_notes(rec.job_ids, ledger, _task_errors(layout, rec.job_ids)))
    evaluation = eval_rows.read_evaluation(run_dir)
    h.eval = eval_alongside.flat_scores(evaluation.records)
    if (bad := eval_rows.trouble(evaluation)) is not None:
        h.notes.append(bad.replace("RUN", rec.name))
    return h


def attempt_cluster(rec, profile: str | None, job_id: str | None) -> str | None:
    """The cluster an attempt ran on: the profile its start line names (as this machine names it: a
    copy over SSH planned there on its own profile), else its job's (two clusters' job ids can meet)."""
    known = set(rec.job_profiles)
    if profile in known:
        return profile
    for name, target in rec.targets.items():
        far = (target or {}).get("far") or {}
        if profile and far.get("profile") == profile and name in known:
            return name
    return rec.profile_of(job_id) if job_id else None


def _attempt_times(rec):
    """sacct's figures of every attempt of the run's jobs, each job asked on the cluster it went to
    (ONE `sacct -D` per cluster; the dashboard asks without the command's own way to the run's)."""
    from launcher.planning import transport

    groups = rec.jobs_by_profile()

    times, messages = {}, []
    for prof, ids in groups.items():  # each group asked on its own profile's cluster (job ids of two may meet)
        with transport.through(transport.profile_job_target(rec, prof), exactly=True):
            got, message = slurm_view.sacct_attempt_times(ids)
        times.update(got)  # job ids of other clusters are other jobs: a run's own seldom meet
        messages += [f"{prof}: {message}" if len(groups) > 1 else message] if message else []
    return times, "; ".join(messages)


def _task_errors(layout: rundir.RunLayout, job_ids: list[str]) -> dict[str, list[str]]:
    """Each job's error lines, for jobs that never started an attempt: task 0's (from its node's
    srun file, the first node's, stdout and stderr), then the batch script's and srun's own
    (``<job>_0_log.err``, which in a run of before was task 0's too)."""
    from launcher.monitor.run_files import error_lines
    from lmcore.run.rank_logs import take_srun_task

    out = {}
    for job in job_ids:
        nodes = layout.submitit_node_logs(job, "out")
        task = take_srun_task((jsonlines.tail_text(nodes[0], 65536) or "").splitlines(), 0) if nodes else []
        batch = jsonlines.tail_text(layout.submitit / rundir.SUBMITIT_TASK_LOG.format(job=job, rank=0, ext="err"), 8192)
        if batch is None and not nodes:
            continue
        out[job] = error_lines(task) + error_lines((batch or "").splitlines())
    return out


def run(args: argparse.Namespace, ctx: Context) -> int:
    rec = runs.find_run(args.run, ctx.environ or None)
    if (trouble := far_copy.refresh(rec)) is not None:
        ctx.err(f"note: {trouble}: shown as last copied")
    h = load_history(rec)
    if args.json:
        ctx.out(json.dumps(h.to_dict(), indent=2))
        return 0

    make_console(ctx).print(startup_view(h) if args.timing else history_view(h))
    return 0
