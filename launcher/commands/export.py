"""lmlaunch export RUN [--step N] --to hf DIR: a checkpoint of any strategy as a transformers model
directory plus its tokenizer (``AutoModelForCausalLM.from_pretrained(DIR)``; ``model.pretrained: DIR``
fine-tunes from it). RUN is a run name, one of its job ids, or a run directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.context import Context
from launcher.planning import runtime_stack
from launcher.runs import far_copy, registry as runs
from lmcore.errors import UserError
from lmcore.run import rundir
from lmcore.run.checkpoint_index import CompleteCheckpoint, complete_checkpoints, describe_choice, newest_intact, verify


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run name, one of its job ids, or a run directory")
    p.add_argument("--to", required=True, choices=["hf"], help="hf: a transformers save_pretrained directory")
    p.add_argument("out", metavar="DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of step N (default: the newest complete one)")



def _newest_intact(run_dir: Path, ckpts: list[CompleteCheckpoint], ctx: Context) -> CompleteCheckpoint:
    """The newest checkpoint whose files all match their checksums; each newer one is said."""
    ckpt = newest_intact(ckpts, lambda c, problems: ctx.err(
        f"warning: {c.path.name} does not hold what was written, not exported: {'; '.join(problems)}"))
    if ckpt is None:
        raise UserError(f"run {run_dir.name} has nothing to export: every complete checkpoint failed its checksums (above)")
    return ckpt


def run(args: argparse.Namespace, ctx: Context) -> int:
    runtime_stack.require("export")  # torch and transformers read and write the weights
    run_dir = runs.run_dir_of(args.run, ctx.environ or None)
    rec = runs.load_record(run_dir.name, ctx.environ or None)
    if rec is not None and (trouble := far_copy.refresh(rec, checkpoint=True)) is not None:
        ctx.err(f"note: {trouble}: shown as last copied")
    plan = json.loads(rundir.RunLayout.of(run_dir).plan.read_text())
    ckpt_dir = rundir.checkpoint_dir_of(run_dir)
    paths = plan.get("paths", {})
    if paths.get("checkpoint_store"):  # kept in a bucket too: a newer one (or --step's) brought to this disk
        from lmcore.run.bucket_fetch import fetch

        got = fetch(paths["checkpoint_store"], paths["checkpoint_store_credentials"], ckpt_dir, step=args.step)
        if got.step is not None or got.problem:
            ctx.err(f"note: {got.said}")
    ckpts = complete_checkpoints(ckpt_dir)
    if not ckpts:
        raise UserError(f"run {run_dir.name} has nothing to export: {describe_choice(ckpt_dir)} in {ckpt_dir}")
    if args.step is None:
        ckpt = _newest_intact(run_dir, ckpts, ctx)
    else:
        found = [c for c in ckpts if c.step == args.step]
        if not found:
            raise UserError(
                f"--step {args.step}: run {run_dir.name} has no complete checkpoint of that step; "
                f"complete: {', '.join(str(c.step) for c in ckpts)}"
            )
        ckpt = found[0]
        problems = verify(ckpt.path)
        if problems:
            raise UserError(f"--step {args.step}: {ckpt.path} does not hold what was written: {'; '.join(problems)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory: choose a new one")
    from lmtrain.checkpoint.export import export_hf  # torch and transformers: only this command needs them
    from lmtrain.checkpoint.weights import UnreadableCheckpoint

    try:
        with ctx.working(f"exporting {run_dir.name} step-{ckpt.step} to {out}: its weights gathered and written"):
            summary = export_hf(plan, ckpt, out)
    except UnreadableCheckpoint as exc:
        raise UserError(f"run {run_dir.name}: {exc}; export an older complete checkpoint with --step N") from exc
    chosen = describe_choice(ckpt_dir, ckpt) if args.step is not None or ckpt.step == ckpts[-1].step \
        else f"step-{ckpt.step} (the newest whose files match their checksums)"
    ctx.out(
        f"exported {run_dir.name} {chosen} to {out}: {summary['parallelism']}, "
        f"{summary['parameters']:,} parameters, {summary['tokenizer']} tokenizer\n"
        f"  load it: AutoModelForCausalLM.from_pretrained({str(out)!r}); fine-tune it: model.pretrained: {out}"
    )
    for problem in summary.get("tokenizer_problems") or ():  # checked against the training tokenizer
        ctx.err(f"warning: the exported tokenizer: {problem.replace('DIR', repr(str(out)))}")
    return 0
