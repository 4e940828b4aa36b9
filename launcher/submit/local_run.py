"""A run on this machine (``lmlaunch run --local``), planned and opened as a submitted run is: the
spec turned into a 1-node job of N local processes (CPU on gloo with the ``local`` profile, or one
process per local GPU with the spec's own profile), its plan, and its run directory written
through the same lifecycle as ``submit`` (new, resumed, archived)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher.planning.memory_check import with_memory
from launcher.planning.model_check import check_model, split_of
from launcher.planning.planner import make_plan
from launcher.planning.resolve import runs_root_for
from launcher.spec.jobfile import load_job
from launcher.spec.profiles import load_profile
from launcher.submit import lifecycle
from lmcore.errors import UserError

LOCAL_PROFILE = "local"


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
    # the model against the installed transformers and the layout, as validate checks it (cached)
    check_model(spec.model, environ, split=split_of(plan.topology), pipeline=plan.parallelism.pipeline,
                schedule=plan.parallelism.schedule)

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
