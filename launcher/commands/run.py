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
import os
import sys
from pathlib import Path

from launcher.context import Context
from launcher.planning import runtime_stack
from launcher.planning.memory_check import with_memory
from launcher.planning.planner import make_plan
from launcher.planning.resolve import runs_root_for
from launcher.spec.jobfile import load_job
from launcher.spec.profiles import load_profile
from launcher.submit import lifecycle
from lmcore.errors import UserError

LOCAL_PROFILE = "local"


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


def local_overrides(
    spec, profile, *, devices: int, max_steps: int | None, name: str, gpus: bool = False
) -> tuple[list[str], list[str]]:
    """Dotted overrides that turn ``spec`` into a 1-node x ``devices`` job on this machine (CPU
    processes on the local profile, or with ``gpus`` one process per local GPU), and the notices
    to print about what changed."""
    notices = []
    part = profile.partitions[profile.default_partition]
    cpus = max(1, (os.cpu_count() or 1) // devices)
    shape = (
        [f"resources.gpus_per_node={devices}", "resources.tasks_per_node=null"]
        if gpus
        else ["resources.gpus_per_node=0", f"resources.tasks_per_node={devices}"]
    )
    out = [
        f"name={name}",
        f"cluster={profile.name}",
        "resources.nodes=1",
        *shape,
        f"resources.cpus_per_task={cpus}",
        f"resources.time={part.max_time}",
        *(f"resources.{k}=null" for k in ("partition", "account", "qos", "constraint", "mem", "exclusive")),
    ]
    if spec.resources.gpus_per_node and not gpus:
        notices.append(
            f"local run: {spec.resources.nodes} node(s) x {spec.resources.gpus_per_node} GPU(s) become "
            f"1 node x {devices} CPU process(es) on gloo"
        )
    if (spec.container is not None and spec.container.runtime != "none") or (profile.container and profile.container.image):
        out.append("container.runtime=none")  # the ranks are this machine's processes
        notices.append("local run: on this machine's interpreter, not in the job's container (container.runtime: none)")
    if max_steps is not None:
        out.append(f"trainer.max_steps={max_steps}")
        if spec.optim.warmup_steps > max_steps:
            out.append(f"optim.warmup_steps={max_steps}")
            notices.append(f"optim.warmup_steps({spec.optim.warmup_steps}) capped at --max-steps({max_steps})")
    return out, notices


def prepare_local_run(
    spec_path: str,
    overrides: list[str],
    *,
    devices: int | None,
    max_steps: int | None,
    name: str | None,
    environ: dict[str, str],
    new: bool = False,
    resume: bool = False,
    new_code: bool = False,
    gpus: bool = False,
    say=print,
):
    """Plan a local run and write its run directory (spec.yaml, plan.json); return the plan.

    CPU (default): the ``local`` profile, ``devices`` processes on gloo. ``gpus``: one process per
    local GPU, planned with the spec's own cluster profile (its GPU shape, NCCL, DeepSpeed)."""
    user_spec = load_job(spec_path, overrides)
    devices = devices if devices is not None else user_spec.world_size
    if devices < 1:
        raise UserError(f"--devices must be >= 1, got {devices}")
    if max_steps is not None and max_steps < 1:
        raise UserError(f"--max-steps must be >= 1, got {max_steps}")
    profile = load_profile(user_spec.cluster if gpus else LOCAL_PROFILE, environ)
    name = name or f"{user_spec.name}-local"
    extra, notices = local_overrides(user_spec, profile, devices=devices, max_steps=max_steps, name=name, gpus=gpus)
    spec = load_job(spec_path, [*overrides, *extra])
    plan = make_plan(spec, profile, runs_root=runs_root_for(profile, environ), python=sys.executable)
    plan = with_memory(spec, profile, plan, environ, force=True)  # the estimate the ledger's measurement meets

    run_dir = Path(plan.paths.run_dir)
    opening = lifecycle.plan_opening(plan, new=new, resume=resume, new_code=new_code)  # as submit
    opening.apply(environ)
    t = plan.topology
    say(
        f"local run '{plan.run_name}': {t.world_size} process(es) on "
        f"{'GPU (one each)' if plan.trainer.accelerator == 'gpu' else 'CPU'}, "
        f"{t.batch_arithmetic()}; run dir {run_dir}"
    )
    for note in (*notices, *plan.notes, *opening.notes):
        say(f"notice: {note}")
    return plan


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
