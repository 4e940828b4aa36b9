"""lmlaunch schema [-o FILE]: the JSON Schema of the job spec, generated from launcher.spec."""

from __future__ import annotations

import argparse
import json

from launcher.context import Context


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help="write to this file instead of stdout")


def job_schema() -> dict:
    from launcher.spec import JobSpec

    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lmlaunch job spec"
    return schema


def run(args: argparse.Namespace, ctx: Context) -> int:
    text = json.dumps(job_schema(), indent=2, sort_keys=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        ctx.out(f"wrote {args.output}")
    else:
        ctx.out(text)
    return 0
