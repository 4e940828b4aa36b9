"""lmlaunch pipeline PIPELINE.yaml [--cluster NAME] [--dry-run] [--new] [--json]"""

from __future__ import annotations

import argparse
import io
import json
from typing import Any

from launcher.commands import add_force_argument
from launcher.commands.cancel import cancel_run
from launcher.context import Context
from launcher.planning.resolve import resolve
from launcher.submit import dependencies, pipeline
from launcher.submit.submission import submit_plan
from lmcore.errors import SpecError, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="pipeline YAML: name, stages (name, spec, overrides, after)")
    p.add_argument("--cluster", help="cluster profile for every stage (overrides the specs' 'cluster')")
    p.add_argument("--dry-run", action="store_true", help="validate and plan every stage; submit nothing")
    p.add_argument("--new", action="store_true", help="archive and replace stages whose run names exist")
    p.add_argument("--json", action="store_true", help="the stages (and their jobs) as JSON")
    add_force_argument(p)


def _plan_all(args: argparse.Namespace, ctx: Context) -> tuple[list[pipeline.StagePlan], list[Any]]:
    """Every stage validated and planned (twice: the second pass puts the earlier stages' run
    directories, now known, into the ${STAGE.checkpoint} references)."""
    pipe = pipeline.load(args.file)
    stages = pipeline.stage_plans(pipe, args.file)
    resolved = [_resolve(s, args, ctx) for s in stages]
    run_dirs = {s.name: r.plan.paths.run_dir for s, r in zip(stages, resolved)}
    final = pipeline.stage_plans(pipe, args.file, run_dir_of=run_dirs)
    resolved = [r if f.overrides == s.overrides else _resolve(f, args, ctx)
                for s, f, r in zip(stages, final, resolved)]
    return final, resolved


def _resolve(stage: pipeline.StagePlan, args: argparse.Namespace, ctx: Context) -> Any:
    try:
        return resolve(stage.spec_path, stage.overrides, args.cluster, ctx.environ, python=ctx.python,
                       force=args.force, data_later=bool(stage.after))  # an earlier stage may prepare its data
    except SpecError as exc:  # nothing is submitted: the stage that fails is named
        raise SpecError([f"pipeline stage '{stage.name}': {p}" for p in exc.problems], source=exc.source,
                        exit_code=exc.exit_code) from None
    except UserError as exc:
        raise UserError(f"pipeline {args.file}, stage '{stage.name}': {exc}", exit_code=exc.exit_code) from None


def run(args: argparse.Namespace, ctx: Context) -> int:
    stages, resolved = _plan_all(args, ctx)
    rows = [{"stage": s.name, "run": s.run, "spec": s.spec_path, "after": s.after,
             "overrides": s.overrides[:-1], "run_dir": r.plan.paths.run_dir} for s, r in zip(stages, resolved)]
    if args.dry_run:
        if args.json:
            ctx.out(json.dumps({"pipeline": args.file, "stages": rows}, indent=2))
            return 0
        ctx.out(f"# pipeline {args.file}: {len(stages)} stage(s), each its own run; nothing submitted")
        for row in rows:
            waits = ", ".join(row["after"]) or "-"
            ctx.out(f"{row['stage']:<12} run {row['run']:<28} after {waits:<24} {' '.join(row['overrides'])}")
        return 0

    submitted: list[str] = []
    for stage, r, row in zip(stages, resolved, rows):
        out = io.StringIO()
        try:
            after = dependencies.parse(stage.after, ctx.environ or None)
            submit_plan(r, Context(stdout=out, stderr=out, environ=ctx.environ, python=ctx.python),
                        new=args.new, spec_path=stage.spec_path, after=after)
        except Exception as exc:
            undone = _cancel(submitted, ctx)
            raise UserError(f"pipeline {args.file}: stage '{stage.name}' was not submitted: {exc}; "
                            + (f"cancelled the stages submitted before it ({', '.join(undone)})" if undone
                               else "nothing was submitted"),
                            exit_code=getattr(exc, "exit_code", 1)) from None
        submitted.append(stage.run)
        row["submitted"] = out.getvalue().splitlines()[0] if out.getvalue() else ""
    if args.json:
        ctx.out(json.dumps({"pipeline": args.file, "stages": rows}, indent=2))
    else:
        for row in rows:
            ctx.out(f"{row['stage']}: {row['submitted']}" + (f" (after {', '.join(row['after'])})" if row["after"] else ""))
        ctx.out(f"next: lmlaunch status  (a waiting stage shows its upstream; `lmlaunch cancel {rows[-1]['run']}` "
                "clears one whose upstream failed)")
    return 0


def _cancel(runs_submitted: list[str], ctx: Context) -> list[str]:
    from launcher.runs import registry as runs

    done = []
    for name in reversed(runs_submitted):
        rec = runs.load_record(name, ctx.environ or None)
        if rec is not None:
            cancel_run(rec, ctx.environ or None)
            done.append(name)
    return done
