"""lmlaunch diff RUN_A RUN_B [--json]: what differs between two runs (spec, plan, environment)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from launcher.context import Context
from launcher.monitor import diff
from launcher.runs import registry as runs
from lmcore.run import rundir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", help="a run name, one of its job ids, or a run directory (local runs)")
    p.add_argument("run_b", help="the run to compare it with")
    p.add_argument("--json", action="store_true", help="the differences as JSON")


def run(args: argparse.Namespace, ctx: Context) -> int:
    facts = []
    for ref in (args.run_a, args.run_b):
        if rundir.RunLayout.of(ref).plan.is_file():  # a run directory (`run --local` runs are not registered)
            facts.append(diff.read_run(Path(ref).name, Path(ref)))
            continue
        rec = runs.find_run(ref, ctx.environ or None)
        facts.append(diff.read_run(rec.name, Path(rec.run_dir)))
    a, b = facts
    found = diff.diff_runs(a, b)
    missing = [f.name for f in facts if f.environment is None]
    if args.json:
        ctx.out(json.dumps({"a": a.name, "b": b.name, "differences": [asdict(d) for d in found],
                            "no_environment_record": missing}, indent=2, default=str))
        return 0
    ctx.out(f"{a.name} vs {b.name}: {len(found)} difference(s)")
    width = max((len(f"{d.section}.{d.key}") for d in found), default=0)
    for d in found:
        ctx.out(f"  {d.section + '.' + d.key:<{width}}  {json.dumps(d.a, default=str)}  |  {json.dumps(d.b, default=str)}")
    for name in missing:
        ctx.out(f"note: run '{name}' has no attempt yet: its environment is not compared")
    return 0
