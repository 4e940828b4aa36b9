"""lmlaunch examples DIR [--force]: the example job specs written into DIR/jobs (from a wheel as
from a checkout), with the commands that prepare the demo's data and validate it."""

from __future__ import annotations

import argparse
from pathlib import Path

from launcher.context import Context
from launcher.spec.examples import DEMO_DATA, write_examples


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="write the specs into DIR/jobs (made if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files under DIR/jobs that differ from the examples")


def run(args: argparse.Namespace, ctx: Context) -> int:
    target = Path(args.dir).expanduser().absolute()
    written = write_examples(target, force=args.force)
    ctx.out(f"wrote {len(written)} example specs under {target / 'jobs'}: "
            + ", ".join(p.name for p in written if p.parent == target / "jobs"))
    ctx.out("next, the demo (jobs/tiny-cpu.yaml) on a cluster profile of yours (`lmlaunch profile init NAME`, "
            "`lmlaunch profiles`):")
    ctx.out(f"  lmlaunch data prepare --shipped-corpus --out {target / DEMO_DATA}")
    ctx.out(f"  lmlaunch validate {target / 'jobs' / 'tiny-cpu.yaml'} --cluster NAME")
    ctx.out(f"  lmlaunch submit {target / 'jobs' / 'tiny-cpu.yaml'} --cluster NAME")
    return 0
