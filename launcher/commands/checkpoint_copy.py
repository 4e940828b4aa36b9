"""lmlaunch _checkpoint accept TEMPORARY NAME | newest DIR (hidden): what this machine's side of a
copy between clusters asks of the other (launcher.runs.far_copy), over ssh: a copied step
directory checked against its manifest and named, or the newest complete checkpoint's name. One
JSON line each: {"problems": [...]} or {"newest": NAME | null}."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.context import Context
from launcher.runs import far_copy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("accept", "newest"))
    p.add_argument("path", help="accept: the copied (temporary) step directory; newest: a checkpoint directory")
    p.add_argument("name", nargs="?", help="accept: the step directory's name once checked (step-S)")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.action == "newest":
        ctx.out(json.dumps({"newest": far_copy.newest(Path(args.path))}))
        return 0
    if not args.name or "/" in args.name:
        ctx.err("_checkpoint accept TEMPORARY NAME: NAME is the step directory's name (step-S)")
        return 2
    problems = far_copy.accept(Path(args.path), args.name)
    ctx.out(json.dumps({"problems": problems}))
    return 1 if problems else 0
