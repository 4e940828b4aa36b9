"""lmlaunch run job.yaml --local [--devices N] [--max-steps K] [overrides...] [--new|--resume]

Runs the job on this machine's CPU with N processes on gloo, through the same entry a SLURM
task runs (lmtrain.task.entry), in a run directory laid out like a submitted run's
(``<runs root>/<name>-local``). The plan is made for 1 node x N tasks on the ``local``
profile; every strategy runs as planned (DeepSpeed on its CPU accelerator, FSDP as FSDP2, on
gloo). Exits with the training's exit code.

No torch import at module import time: the heavy work happens in the child processes.
"""

from __future__ import annotations

import argparse

from launcher.context import Context
from launcher.planning import runtime_stack
from launcher.submit.local_run import prepare_local_run
from lmcore.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=20")
    p.add_argument("--local", action="store_true", help="run here on CPU (the only mode of `run`)")
    p.add_argument("--devices", type=int, default=None, help="local processes (ranks); default: the spec's world size")
    p.add_argument("--max-steps", type=int, default=None, help="train only K optimizer steps")
    p.add_argument("--name", help="run name (default: <spec name>-local)")
    p.add_argument("--gpus", action="store_true",
                   help="one process per local GPU (--devices of them), planned with the spec's cluster profile")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--new", action="store_true", help="start over if the run exists (the old run dir is archived)")
    g.add_argument("--resume", action="store_true", help="continue the existing local run from its newest checkpoint")
    p.add_argument("--new-code", action="store_true",
                   help="with --resume: run the current code instead of the run's code snapshot (says what changed)")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if not args.local:
        raise UserError(
            "`lmlaunch run` runs on this machine and needs --local; to run on SLURM use `lmlaunch submit`"
        )
    runtime_stack.require("run --local")
    plan = prepare_local_run(
        args.spec, args.overrides, devices=args.devices, max_steps=args.max_steps, name=args.name,
        environ=ctx.environ, new=args.new, resume=args.resume, new_code=args.new_code, gpus=args.gpus, say=ctx.out,
    )
    from lmtrain.local.launch import launch

    code = launch(plan.paths.run_dir, plan.topology.world_size, plan_env=plan.env, out=ctx.stdout,
                  threads_per_proc=plan.slurm.cpus_per_task)
    ctx.out(f"local run '{plan.run_name}' exited with code {code}; run dir {plan.paths.run_dir}")
    return code
