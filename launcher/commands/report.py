"""lmlaunch report RUN [-o report.png] [--json]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.commands.history import load_history
from launcher.context import Context
from launcher.monitor.report import build_report, draw_png, draw_sweep_png, sweep_curves
from launcher.runs import registry as runs
from lmcore import jsonlines
from lmcore.errors import UserError
from lmcore.run import rundir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name, one of its job ids, or a run directory (local runs)")
    p.add_argument("-o", "--output", help="PNG to write (default: <run dir>/report.png)")
    p.add_argument("--json", action="store_true", help="the summary as JSON (the PNG is still written)")


def run(args: argparse.Namespace, ctx: Context) -> int:
    points = runs.sweep_records(args.run, ctx.environ or None)
    if points and runs.load_record(args.run, ctx.environ or None) is None:
        return _sweep_report(args, ctx, points)
    rec = runs.find_run(args.run, ctx.environ or None)
    run_dir = Path(rec.run_dir)
    heartbeat = jsonlines.read_jsonl(rundir.RunLayout.of(run_dir).heartbeat)
    data = build_report(rec.name, heartbeat, load_history(rec))
    if not data.steps:
        raise UserError(f"run '{rec.name}' has no training steps in {rundir.RunLayout.of(run_dir).heartbeat} yet; "
                        f"nothing to plot (`lmlaunch status {rec.name}`)", exit_code=1)
    out = Path(args.output) if args.output else rundir.RunLayout.of(run_dir).report
    if out.suffix.lower() != ".png":
        raise UserError(f"-o {out}: the report is a PNG; give a path ending in .png")
    with ctx.working(f"drawing {out}", quiet=args.json):
        draw_png(data, out)
    if args.json:
        ctx.out(json.dumps({**data.to_dict(), "png": str(out)}, indent=2))
    else:
        for line in data.summary:
            ctx.out(line)
        ctx.out(f"wrote {out}")
    return 0


def _sweep_report(args: argparse.Namespace, ctx: Context, points: list[runs.RunRecord]) -> int:
    """`report SWEEP`: every point's loss curve on one plot, the best one marked."""
    data = sweep_curves([(r.name, jsonlines.read_jsonl(rundir.RunLayout.of(r.run_dir).heartbeat)) for r in points])
    if not any(xs for xs, _ in data["curves"].values()):
        raise UserError(f"sweep '{args.run}' has no training steps yet; nothing to plot", exit_code=1)
    out = Path(args.output) if args.output else rundir.RunLayout.of(Path(points[0].run_dir).parent / args.run).report
    if out.suffix.lower() != ".png":
        raise UserError(f"-o {out}: the report is a PNG; give a path ending in .png")
    from launcher.search import driver as search_driver

    search = search_driver.trial_rows(args.run, ctx)  # a search: its trials, the best by its objective
    if search is not None and search[1] is not None:
        data["best"] = search[1]
    with ctx.working(f"drawing {out}", quiet=args.json):
        draw_sweep_png(args.run, data, out)
    summary = {"sweep": args.run, "points": len(points), "best": data["best"], "final_loss": data["final_loss"],
               "png": str(out)}
    if search is not None:
        summary["trials"] = search[0]
    if args.json:
        ctx.out(json.dumps(summary, indent=2))
        return 0
    if search is None:
        ctx.out(f"sweep {args.run}: {len(points)} points, best {data['best']} (final loss "
                f"{data['final_loss'].get(data['best'], float('nan')):.4f})")
    else:
        rows = search[0]
        ctx.out(f"search {args.run}: {len(rows)} trials, best {data['best'] or '- (none completed)'}")
        for r in rows:
            params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                               if k not in ("trial", "run", "state", "objective", "pruned_at", "best", "why"))
            value = f"{r['objective']:.4f}" if isinstance(r["objective"], float) else "-"
            pruned = f" at step {r['pruned_at']}" if r["pruned_at"] is not None else ""
            ctx.out(f"  {r['trial']:>3} {r['run']:<24} {r['state'] + pruned:<22} {value:>8}  {params}"
                    + ("  <- best" if r["best"] else ""))
    ctx.out(f"wrote {out}")
    return 0
