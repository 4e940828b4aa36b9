"""lmlaunch validate job.yaml [overrides...] [--cluster NAME]"""

from __future__ import annotations

import argparse

from launcher.commands import add_spec_arguments
from launcher.context import Context
from launcher.resolve import resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p, "resources.nodes=4")


def run(args: argparse.Namespace, ctx: Context) -> int:
    r = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python)
    t = r.plan.topology
    ctx.out(
        f"ok: {args.spec} is valid for cluster '{r.profile.name}': "
        f"nodes({t.nodes}) x tasks_per_node({t.tasks_per_node}) = world_size({t.world_size}); "
        f"micro_batch({t.micro_batch_size}) x accumulation({t.grad_accum}) x world_size({t.world_size}) "
        f"= global_batch({t.global_batch_size})"
    )
    for note in r.plan.notes:
        ctx.out(f"note: {note}")
    return 0
