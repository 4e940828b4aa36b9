"""lmlaunch validate job.yaml [overrides...] [--cluster NAME] [--fit] [--json] [--force]"""

from __future__ import annotations

import argparse
import json
from typing import Any

from launcher.commands import add_spec_arguments, with_examples
from launcher.context import Context
from launcher.planning.memory_check import planned, proposal, summary
from launcher.planning.resolve import cluster_argument, resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    with_examples(
        p,
        'lmlaunch validate jobs/tiny-cpu.yaml',
        'lmlaunch validate jobs/gpt2-124m.yaml --cluster mycluster resources.nodes=2',
        'lmlaunch validate jobs/llama-7b-zero3.yaml --fit        # the largest micro batch that fits',
        'lmlaunch validate jobs/tiny-cpu.yaml --json',
    )
    add_spec_arguments(p, "resources.nodes=4")
    p.add_argument("--fit", action="store_true",
                   help="propose the largest micro batch (with ZeRO stage, checkpointing, offload) that fits the GPU, keeping the global batch")
    p.add_argument("--json", action="store_true", help="the topology and the memory plan as JSON")


def run(args: argparse.Namespace, ctx: Context) -> int:
    with ctx.working(f"validating {args.spec}: the spec, its model built and traced, its memory", quiet=args.json):
        r = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python,
                    force=args.force or args.fit, several=True)
    if r.spec.clusters:
        return _several(args, ctx, r)
    t = r.plan.topology
    if args.json:
        ctx.out(json.dumps({"ok": True, "spec": args.spec, "cluster": r.profile.name,
                            "topology": t.to_json(),
                            "memory": r.plan.memory, "notes": list(r.plan.notes)}, indent=2, sort_keys=True))
        return 0
    ctx.out(
        f"ok: {args.spec} is valid for cluster '{r.profile.name}': "
        f"{t.arithmetic()}"
    )
    if r.plan.memory:
        ctx.out("memory per rank (planned):")
        for line in summary(r.plan.memory):
            ctx.out(line)
    for note in r.plan.notes:
        ctx.out(f"note: {note}")
    if args.fit:
        got = planned(r.spec, r.profile, r.plan, ctx.environ)  # the facts come from the cache resolve filled
        for line in [got] if isinstance(got, str) else proposal(got, r.profile):
            ctx.out(line)
    return 0


def _several(args: argparse.Namespace, ctx: Context, first: Any) -> int:
    """A spec naming several clusters: valid when each can run it and they can carry one run between
    them (launcher.planning.clusters); each cluster's plan in brief."""
    from launcher.planning.clusters import plan_each

    overrides = cluster_argument(args.cluster, args.overrides)[1]
    plans = plan_each(args.spec, overrides, first.spec.clusters, ctx.environ, ctx.python,
                      force=args.force or args.fit, done=first)
    if args.json:
        ctx.out(json.dumps({"ok": True, "spec": args.spec, "clusters": [
            {"cluster": r.profile.name, "topology": r.plan.topology.to_json(),
             "memory": r.plan.memory, "notes": list(r.plan.notes)} for r in plans]}, indent=2, sort_keys=True))
        return 0
    ctx.out(f"ok: {args.spec} is valid for each of its clusters ({', '.join(r.profile.name for r in plans)}); "
            "submit places it where it starts soonest")
    for r in plans:
        ctx.out(f"  {r.profile.name}: {r.plan.topology.arithmetic()}")
        for note in r.plan.notes:
            ctx.out(f"    note: {note}")
    return 0
