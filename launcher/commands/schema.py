"""lmlaunch schema [-o FILE] [--format json|markdown]: the JSON Schema of the job spec for
editors, or the reference documentation generated from it (docs/spec-reference.md)."""

from __future__ import annotations

import argparse
import json

from launcher.context import Context
from launcher.spec.schema_docs import job_schema, reference_markdown


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.add_argument(
        "--format",
        choices=("json", "markdown"),
        default="json",
        help="json: JSON Schema (default); markdown: the reference docs (docs/spec-reference.md)",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.format == "markdown":
        text = reference_markdown().rstrip("\n")
    else:
        text = json.dumps(job_schema(), indent=2, sort_keys=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        ctx.out(f"wrote {args.output}")
    else:
        ctx.out(text)
    return 0
