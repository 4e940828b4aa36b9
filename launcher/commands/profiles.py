"""lmlaunch profiles [--json]"""

from __future__ import annotations

import argparse
import json

from launcher.context import Context
from launcher.spec.profiles import available_profiles, load_profile_file, profile_summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, ctx: Context) -> int:
    rows = [profile_summary(load_profile_file(path)) for path in available_profiles(ctx.environ or None).values()]
    if args.json:
        ctx.out(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        parts = ", ".join(f"{k} (max {v})" for k, v in row["partitions"].items())
        gpus = f"{row['gpus_per_node']} GPUs/node" if row["gpus_per_node"] else "CPU only"
        ctx.out(f"{row['name']:<14} {gpus:<14} partitions: {parts}")
        if row["description"]:
            ctx.out(f"{'':<14} {row['description']}")
        if row["login"]:
            ctx.out(f"{'':<14} from a workstation: lmlaunch --remote {row['name']} COMMAND (ssh {row['login']})")
    return 0
