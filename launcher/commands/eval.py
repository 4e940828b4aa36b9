"""lmlaunch eval RUN [--tasks A,B] [--steps N,M] [--limit K] [--dry-run]: a run's checkpoints scored
with lm-evaluation-harness as an ordinary SLURM job, the way the evaluator alongside the training
scores them (eval.alongside: the same module, records and tasks), for a run trained without one or
with other tasks. Scores go to the run's ``eval/scores.jsonl``: a checkpoint scored already with the
tasks asked is not scored again (with other tasks, a further line of its scores); ``status``, ``history``, the exporter and the dashboard show them.
A run whose checkpoints are in a bucket (checkpoint.dir s3://) has those scored too: the job downloads
each one the disk lacks, verified, before it scores it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from launcher.context import Context
from launcher.planning import eval_tasks, transport
from launcher.planning.resolve import eval_interpreter
from launcher.runs import registry as runs
from launcher.spec.profiles import load_profile
from launcher.submit import script, submission
from lmcore.atomic import write_json
from lmcore.errors import UserError
from lmcore.job.plan import LaunchPlan
from lmcore.job.spec import SHIPPED_EVAL_TASKS
from lmcore.run import rundir
from lmcore.run.checkpoint_index import complete_checkpoints
from lmcore.run.eval_alongside import EVAL_DIR, EVALUATOR_LOG, EvaluatorPlan, read_scores, scored_steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name, one of its job ids, or a run directory")
    p.add_argument("--tasks", help="lm-eval task names, comma separated (default: the run's eval.alongside tasks, "
                                   "else the shipped lmlaunch_pydoc_choice,lmlaunch_pydoc_perplexity)")
    p.add_argument("--task-dir", action="append", default=[], help="a directory of lm-eval task YAML files (repeatable)")
    p.add_argument("--steps", help="only these checkpoint steps, comma separated (default: every complete one)")
    p.add_argument("--limit", type=int, help="at most this many examples per task")
    p.add_argument("--partition", help="the job's partition (default: the run's evaluator's, else the run's)")
    p.add_argument("--cpus", type=int, help="CPU cores of the job (default: the run's evaluator's, else a task's)")
    p.add_argument("--time", type=int, default=60, help="the job's time limit in minutes (default 60)")
    p.add_argument("--dry-run", action="store_true", help="print the job script; submit nothing")



def evaluator_for(plan: LaunchPlan, args: argparse.Namespace) -> EvaluatorPlan:
    """The run's own evaluator (or the shipped tasks on the run's partition), with the options' changes."""
    base = EvaluatorPlan.from_json(plan.evaluator) if plan.evaluator else EvaluatorPlan(
        partition=plan.slurm.partition, nodes=1, cpus_per_task=plan.slurm.cpus_per_task,
        gpus=min(1, plan.slurm.gpus_per_node), gres=None, mem=None, tasks=SHIPPED_EVAL_TASKS,
        log=str(Path(plan.paths.run_dir) / EVALUATOR_LOG),
        python=eval_interpreter(load_profile(plan.profile), sys.executable))
    # the steps are named (every complete one, or --steps): none skipped for every_n_steps or behind
    base = dataclasses.replace(base, every_n_steps=None, behind="all")
    if base.gpus and not base.gres:
        base = dataclasses.replace(base, gres=(plan.slurm.gres or "gpu:1").rsplit(":", 1)[0] + f":{base.gpus}")
    change = {k: v for k, v in (("partition", args.partition), ("cpus_per_task", args.cpus), ("limit", args.limit))
              if v is not None}
    if args.tasks:
        change["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if args.task_dir:
        change["task_dirs"] = tuple(str(Path(d).resolve()) for d in args.task_dir)
    return dataclasses.replace(base, **change)


def _bucket_steps(plan: LaunchPlan) -> list[int]:
    """The steps complete in the run's bucket (checkpoint.dir s3://), which the job downloads before it
    scores them; [] for a run without one. A bucket that cannot be listed from here is refused."""
    if not plan.paths.checkpoint_store:
        return []
    from lmcore.objects.checkpoints import ObjectStoreError
    from lmcore.run.bucket_fetch import complete_steps

    try:
        return complete_steps(plan.paths.checkpoint_store, plan.paths.checkpoint_store_credentials or "")
    except (ObjectStoreError, OSError) as exc:
        raise UserError(f"cannot list the run's checkpoints in {plan.paths.checkpoint_store}: {exc}", exit_code=1) from exc


def _check(ev: EvaluatorPlan, run_dir: Path, steps: str | None, plan: LaunchPlan) -> list[int]:
    """The steps to score (exit 2 on a bad task, directory or step; nothing submitted)."""
    bad = [f"--task-dir {d}: not a directory" for d in ev.task_dirs if not Path(d).is_dir()]
    unknown, looked = eval_tasks.unknown_tasks(ev.tasks, ev.task_dirs, ev.python or None)
    bad += [f"--tasks: lm-eval knows no task '{t}'" for t in unknown] if looked else []
    found = sorted({c.step for c in complete_checkpoints(rundir.checkpoint_dir_of(run_dir))} | {*_bucket_steps(plan)})
    asked = [int(s) for s in steps.split(",")] if steps else found
    bad += [f"--steps: step {s} has no complete checkpoint (complete: {', '.join(map(str, found)) or 'none'})"
            for s in asked if s not in found]
    if bad:
        raise UserError("; ".join(bad), exit_code=2)
    done = scored_steps(read_scores(run_dir), ev.tasks)
    return [s for s in asked if s not in done]


def run(args: argparse.Namespace, ctx: Context) -> int:
    run_dir = runs.run_dir_of(args.run, ctx.environ or None)
    plan = LaunchPlan.from_dict(json.loads(rundir.RunLayout.of(run_dir).plan.read_text()))
    rec = runs.find_run(args.run, ctx.environ or None) if not Path(args.run).is_dir() else None
    if rec is not None and transport.active_jobs_of(rec, ctx.environ or None):  # one evaluator at a time writes the run's eval/
        raise UserError(f"run {rec.name} is queued or running: its evaluator alongside scores its checkpoints; "
                        f"`lmlaunch eval` scores a finished run's", exit_code=2)
    if Path(plan.paths.run_dir).resolve() != run_dir.resolve():
        raise UserError(f"{run_dir} was planned as {plan.paths.run_dir} (archived or moved): its plan names another "
                        "directory's checkpoints; evaluate the run where it lives", exit_code=2)
    ev = evaluator_for(plan, args)
    todo = _check(ev, run_dir, args.steps, plan)
    if not todo:
        ctx.out(f"run {plan.run_name}: every asked checkpoint is scored already (`lmlaunch history {plan.run_name}`)")
        return 0
    path = run_dir / EVAL_DIR / f"evaluator-{time.strftime('%Y%m%d-%H%M%S')}.json"
    job = script.render_eval_job(plan, ev, str(path), steps=",".join(map(str, todo)), time_minutes=args.time)
    if args.dry_run:
        ctx.out(job.text)
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, ev.to_json())
    job_id = submission.submit_script(job, path.with_suffix(".sh"))
    ctx.out(f"submitted job {job_id}: scores {len(todo)} checkpoint(s) of {plan.run_name} "
            f"({', '.join(ev.tasks)})\n  follow: lmlaunch logs {plan.run_name} --evaluator; "
            f"scores: lmlaunch history {plan.run_name}")
    return 0
