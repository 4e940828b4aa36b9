"""lmlaunch validate job.yaml [overrides...] [--cluster NAME] [--fit] [--json] [--force]"""

from __future__ import annotations

import argparse
import json

from launcher.commands import add_spec_arguments
from launcher.context import Context
from launcher.planning.memory_check import planned, proposal, summary
from launcher.planning.resolve import resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p, "resources.nodes=4")
    p.add_argument("--fit", action="store_true",
                   help="propose the largest micro batch (with ZeRO stage, checkpointing, offload) that fits the GPU, keeping the global batch")
    p.add_argument("--json", action="store_true", help="the topology and the memory plan as JSON")


def run(args: argparse.Namespace, ctx: Context) -> int:
    r = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python,
                force=args.force or args.fit)
    t = r.plan.topology
    if args.json:
        ctx.out(json.dumps({"ok": True, "spec": args.spec, "cluster": r.profile.name,
                            "topology": {k: getattr(t, k) for k in t.__dataclass_fields__},
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
