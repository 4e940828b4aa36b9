"""lmlaunch doctor job.yaml [overrides...] [--cluster NAME] [--json]: preflight on the login node."""

from __future__ import annotations

import argparse
import json

from launcher import doctor
from launcher.commands import add_spec_arguments
from launcher.context import Context
from launcher.core.errors import ExitCode
from launcher.resolve import resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p, "checkpoint.dir=/scratch/ckpt")
    p.add_argument("--json", action="store_true", help="every check with its figures, as JSON")


def run(args: argparse.Namespace, ctx: Context) -> int:
    r = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python)
    checks = doctor.diagnose(r.plan, r.profile, ctx.environ or None)
    failed = [c for c in checks if c.status == doctor.FAIL]
    if args.json:
        ctx.out(json.dumps({"spec": args.spec, "run": r.plan.run_name, "ok": not failed,
                            "checks": doctor.to_json(checks)}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            ctx.out(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
        ctx.out(f"{len(failed)} failed, {sum(c.status == doctor.WARN for c in checks)} warnings: "
                + ("fix the failures before submitting" if failed else "ready to submit"))
    return ExitCode.FAILURE if failed else 0
