"""lmlaunch _runs: run names, one per line (hidden; shell completion calls it, so it stays fast:
it lists the registry directory and reads nothing else)."""

from __future__ import annotations

import argparse

from launcher.context import Context
from launcher.runs.registry import registry_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", nargs="?", default="", help="only names starting with this")


def run(args: argparse.Namespace, ctx: Context) -> int:
    d = registry_dir(ctx.environ or None)
    try:
        names = sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json") and not p.name.startswith("."))
    except OSError:
        names = []
    for n in names:
        if n.startswith(args.prefix):
            ctx.out(n)
    return 0
