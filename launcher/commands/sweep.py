"""lmlaunch sweep SPEC SWEEP.yaml [overrides...] [--max-parallel N] [--dry-run] [--new] [--json] [--detach]
lmlaunch sweep results SWEEP [--json | --csv]
lmlaunch sweep resume SEARCH [--detach]

A sweep file with grid / zip / random is one throttled SLURM array (launcher.search.sweep); one with
``search: optuna`` is a search whose driver asks an Optuna study for trials as slots free up
(launcher.search.driver)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import time
from pathlib import Path
from typing import Any

from launcher.commands import add_force_argument
from launcher.context import Context
from launcher.monitor import sweep_rows
from launcher.planning.resolve import resolve
from launcher.runs import registry as runs
from launcher.search import sweep
from launcher.search.sweep_arrays import Group, spread_over, submit_groups
from launcher.submit.arrays import max_array_size
from launcher.submit.script import render_array_script
from lmcore import jsonlines
from lmcore.errors import SpecError, UserError
from lmcore.run import eval_alongside, rundir
from lmcore.search.search_spec import SearchFile
from lmcore.search.study_storage import StorageRef


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="job spec YAML (or `results` to tabulate a sweep's points, `resume` to drive a search on)")
    p.add_argument("sweep", help="sweep YAML: name, grid / zip / random, max_parallel, or search: optuna with params, "
                                 "trials, sampler, pruner, objective (after `results` or `resume`: its name)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every point")
    p.add_argument("--cluster", help="cluster profile (overrides the spec's 'cluster' and 'clusters'); a,b: an array "
                                     "on each, the points dealt between them")
    p.add_argument("--max-parallel", type=int, help="at most this many points at once (the array's %%N)")
    p.add_argument("--dry-run", action="store_true", help="the table of points and the array script; submit nothing")
    p.add_argument("--new", action="store_true", help="archive and replace points whose run names exist")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.add_argument("--csv", action="store_true", help="with results: as CSV")
    p.add_argument("--by", metavar="TASK/METRIC",
                   help="with results: rank the points by their newest lm-eval score of TASK/METRIC (scored by "
                        "`lmlaunch eval POINT`), best first; the metric's name says which way is better")
    p.add_argument("--detach", action="store_true",
                   help="a search: run its driver in the background (it writes driver.log in the search's directory)")
    add_force_argument(p)


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.spec == "results":
        return _results(args, ctx)
    if args.spec == "resume":
        from launcher.search import driver as search_driver

        return search_driver.resume(args.sweep, ctx, detach=args.detach)
    if args.max_parallel is not None and args.max_parallel < 1:
        raise UserError(f"--max-parallel must be at least 1, got {args.max_parallel}")
    sw = sweep.load(args.sweep)
    if isinstance(sw, SearchFile):
        from launcher.search import driver as search_driver

        if args.max_parallel is not None:
            sw = sw.model_copy(update={"max_parallel": args.max_parallel})
        return search_driver.start(args.spec, args.sweep, list(args.overrides), args.cluster, sw, ctx,
                                   detach=args.detach, dry_run=args.dry_run, json_out=args.json,
                                   local_cluster=_local_cluster_storage)
    points = sweep.points(sw)
    parallel = min(args.max_parallel or sw.max_parallel or len(points), len(points))
    groups, said = _groups(args, ctx, sw, points, parallel)
    plans = _plans(args, ctx, sw, points, {i: g.cluster for g in groups if g.cluster for i in g.points})
    for g in groups:
        sweep.check_one_shape([plans[i] for i in g.points], [points[i] for i in g.points], args.sweep)
    sweep_dir = Path(plans[0].paths.run_dir).parent / sw.name
    if rundir.RunLayout.of(sweep_dir).plan.exists():
        raise UserError(f"{sweep_dir} is the run directory of a run named '{sw.name}': give the sweep another name")
    run_dirs = [p.paths.run_dir for p in plans]
    if args.dry_run:
        return _dry_run(args, ctx, sw.name, points, plans, run_dirs, sweep_dir, groups, said)
    for line in said:
        ctx.out(line)
    arrays, job_ids = submit_groups(plans, run_dirs, sweep_dir, groups, new=args.new, environ=ctx.environ or None)
    _record(args, ctx, sw.name, plans, points, job_ids, arrays, sweep_dir, parallel, groups)
    if args.json:
        ctx.out(json.dumps({"sweep": sw.name, "arrays": arrays, "max_parallel": parallel,
                            "points": [{"run": p.run_name, "job_id": j} for p, j in zip(plans, job_ids)]}, indent=2))
    else:
        ctx.out(f"submitted sweep '{sw.name}': {len(points)} points as array job{'s' if len(arrays) > 1 else ''} "
                f"{', '.join(arrays)}, at most {parallel} at once"
                + (f" in all, over {', '.join(str(g.cluster) for g in groups)}" if len(groups) > 1 else ""))
        for plan, j in zip(plans, job_ids):
            ctx.out(f"  {plan.run_name:<24} job {j}")
        ctx.out(f"next: lmlaunch status {sw.name}; lmlaunch sweep results {sw.name}; lmlaunch cancel {sw.name}")
    return 0


def _groups(args: argparse.Namespace, ctx: Context, sw: Any, points: list[Any], parallel: int) -> tuple[list[Group], list[str]]:
    """One array for a sweep on one cluster; for a spec naming several (``clusters``, ``--cluster
    a,b``), an array per cluster with the points dealt between them (launcher.search.sweep_arrays),
    and what the clusters said."""
    whole = [Group(None, list(range(len(points))), parallel)]
    ov = [*args.overrides, *sweep.overrides(points[0]), f"name={sweep.run_name(sw.name, 0)}"]
    try:
        first = resolve(args.spec, ov, args.cluster, ctx.environ, python=ctx.python, force=args.force, several=True)
    except UserError:
        return whole, []  # said by _plans, naming the point
    if not first.spec.clusters or (args.cluster and "," not in args.cluster):
        return whole, []
    return spread_over(first, args.spec, ov, len(points), parallel, ctx.environ, ctx.python, force=args.force)


def _plans(args: argparse.Namespace, ctx: Context, sw: Any, points: list[Any], cluster_of: dict[int, str]) -> list[Any]:
    """Every point's plan (on its cluster); the whole sweep fails before anything is submitted, naming the point."""
    plans = []
    for i, pt in enumerate(points):
        ov = [*args.overrides, *sweep.overrides(pt), f"name={sweep.run_name(sw.name, i)}"]
        try:
            plans.append(resolve(args.spec, ov, cluster_of.get(i, args.cluster), ctx.environ, python=ctx.python,
                                 force=args.force).plan)
        except SpecError as exc:
            raise SpecError([f"sweep {args.sweep}, point {i} ({', '.join(sweep.overrides(pt))}): {p}"
                             for p in exc.problems], source=exc.source) from None
        except UserError as exc:
            raise UserError(f"sweep {args.sweep}, point {i} ({', '.join(sweep.overrides(pt))}): {exc}",
                            exit_code=exc.exit_code) from None
    return plans


def _record(args: argparse.Namespace, ctx: Context, name: str, plans: list[Any], points: list[Any],
            job_ids: list[str], arrays: list[str], sweep_dir: Path, parallel: int, groups: list[Group]) -> None:
    """Each point's registry record (with its cluster's way to SLURM) and the sweep's sweep.json."""
    from launcher.planning import transport
    from launcher.spec.profiles import load_profile

    now = time.time()
    targets = {p: transport.recorded(load_profile(p, ctx.environ or None)) for p in {plan.profile for plan in plans}}
    for plan, pt, job in zip(plans, points, job_ids):
        rec = runs.RunRecord(name=plan.run_name, profile=plan.profile, run_dir=plan.paths.run_dir,
                             spec_path=str(Path(args.spec).absolute()), job_ids=[job], submitted_at=[now],
                             max_steps=plan.trainer.max_steps, sweep=name, point=pt, targets=targets[plan.profile],
                             job_profiles=[plan.profile])
        runs.save_record(rec, ctx.environ or None)
    several = {str(g.cluster): {"points": [plans[i].run_name for i in g.points], "max_parallel": g.max_parallel}
               for g in groups if g.cluster}
    (sweep_dir / "sweep.json").write_text(json.dumps({
        "name": name, "spec": str(Path(args.spec).absolute()), "file": str(Path(args.sweep).absolute()),
        "max_parallel": parallel, "arrays": arrays, **({"clusters": several} if several else {}),
        "points": [{"run": p.run_name, "job_id": j, "point": pt} for p, j, pt in zip(plans, job_ids, points)],
    }, indent=2) + "\n")


def _dry_run(args, ctx, name: str, points, plans, run_dirs, sweep_dir: Path, groups: list[Group], said: list[str]) -> int:
    scripts = [render_array_script(plans[g.points[0]], [run_dirs[i] for i in g.points][:max_array_size(query=False)],
                                   str(g.folder(sweep_dir)), g.max_parallel) for g in groups]
    parallel = sum(g.max_parallel for g in groups)
    if args.json:
        ctx.out(json.dumps({"sweep": name, "max_parallel": parallel, "script": scripts[0],
                            "points": [{"run": p.run_name, "point": pt} for p, pt in zip(plans, points)],
                            **({"clusters": [{"cluster": g.cluster, "points": [plans[i].run_name for i in g.points],
                                              "max_parallel": g.max_parallel, "script": sc}
                                             for g, sc in zip(groups, scripts)]} if len(groups) > 1 or groups[0].cluster
                               else {})}, indent=2))
        return 0
    keys = list(dict.fromkeys(k for pt in points for k in pt))
    arrays = "one SLURM array" if len(groups) == 1 else f"one SLURM array on each of {len(groups)} clusters"
    ctx.out(f"# sweep '{name}': {len(points)} points, {arrays}, at most {parallel} at once; nothing submitted")
    for line in said:
        ctx.out(f"# {line}")
    ctx.out("  ".join(["RUN".ljust(24), *keys]))
    for plan, pt in zip(plans, points):
        ctx.out("  ".join([plan.run_name.ljust(24), *(str(pt.get(k, "-")) for k in keys)]))
    for g, script in zip(groups, scripts):
        ctx.out("")
        ctx.out("## array job script (as submitted)" + (f" on {g.cluster}" if g.cluster else ""))
        ctx.out(script.rstrip("\n"))
    return 0


def _results(args: argparse.Namespace, ctx: Context) -> int:
    from launcher.search import driver as search_driver

    found = search_driver.trial_rows(args.sweep, ctx)
    if found is not None:
        return _table(args, ctx, found[0], search=True)
    records = runs.sweep_records(args.sweep, ctx.environ or None)
    if not records:
        raise UserError(f"no sweep named {args.sweep!r} in the registry")
    finals = {}
    for r in records:
        beats = jsonlines.read_jsonl(rundir.RunLayout.of(r.run_dir).heartbeat)
        steps = [b for b in beats if b.get("event") == "step"]
        vals = [b["val_loss"] for b in beats if b.get("event") == "val" and isinstance(b.get("val_loss"), (int, float))]
        ends = [e for e in jsonlines.read_jsonl(rundir.RunLayout.of(r.run_dir).ledger) if e.get("event") == "end"]
        finals[r.name] = {"state": ends[-1].get("reason") if ends else "not ended",
                          "step": steps[-1].get("step") if steps else None,
                          "loss": steps[-1].get("loss") if steps else None,
                          "val_loss": vals[-1] if vals else None, "best_val_loss": min(vals) if vals else None}
    rows = sweep_rows.results(records, finals)
    if args.by:
        rows = sweep_rows.ranked_by_eval(rows, {r.name: eval_alongside.read_scores(r.run_dir) for r in records},
                                         args.by)
    return _table(args, ctx, rows, search=False)


def _table(args: argparse.Namespace, ctx: Context, rows: list[dict[str, Any]], *, search: bool) -> int:
    if args.json:
        ctx.out(json.dumps({"sweep": args.sweep, "trials" if search else "points": rows}, indent=2))
    elif not rows:
        ctx.out(f"search '{args.sweep}' has no trials yet")
    elif args.csv:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        ctx.out(buf.getvalue().rstrip("\n"))
    else:
        cols = [c for c in rows[0] if not (search and c in ("best", "why"))]
        cells = [[f"{row[c]:.4g}" if isinstance(row[c], float) else "-" if row[c] is None else str(row[c])
                  for c in cols] for row in rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
        ctx.out("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
        for row, line in zip(rows, cells):
            ctx.out(("  ".join(v.ljust(w) for v, w in zip(line, widths))
                     + ("  <- best" if search and row["best"] else "")
                     + (f"  ({row['why']})" if search and row.get("why") and row["state"] == "failed" else "")).rstrip())
    return 0


def _local_cluster_storage() -> StorageRef:
    """The local cluster's database for a search's study (a profile with ``sweep_storage:
    {local_cluster: true}``): made there at the first search."""
    from launcher.localcluster import cluster

    return cluster.sweeps_storage()
