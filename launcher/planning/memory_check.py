"""Will it fit? The plan's per-rank memory (launcher.planning.memory) for a validated spec, shown by
validate and the dry run, kept in plan.json (``memory``), and a GPU job whose peak exceeds the
profile's ``gpu_memory`` refused before queue time with the cheapest changes that fit (``--force``
submits it anyway). ``lmlaunch validate --fit`` proposes the largest micro batch that fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from launcher.planning import host_memory, memory, memory_fixes, memory_stages
from launcher.planning.memory_inputs import model_facts, unavailable
from launcher.spec.profiles import Profile
from lmcore.errors import ExitCode, UserError
from lmcore.job.plan import MODEL_STATE_ROWS, LaunchPlan
from lmcore.job.spec import JobSpec, mem_to_mb


def setup_of(spec: JobSpec, plan: LaunchPlan) -> memory.Setup:
    t, zero = spec.trainer, (plan.deepspeed or {}).get("zero_optimization", {})
    return memory.Setup(
        parallelism=plan.parallelism, offload_optimizer=t.offload_optimizer,
        offload_params=t.offload_params, precision=t.precision,
        micro_batch=spec.data.micro_batch_size, global_batch=t.global_batch_size,
        checkpointing=spec.model.activation_checkpointing, gpu=plan.topology.accelerator == "gpu",
        reduce_bucket=int(zero.get("reduce_bucket_size", 500_000_000)), overlap_comm=bool(zero.get("overlap_comm", True)),
        compiled=bool(spec.model.compile),
    )


def capacity_of(profile: Profile) -> int | None:
    return mem_to_mb(profile.gpu_memory) << 20 if profile.gpu_memory else None


@dataclasses.dataclass(frozen=True)
class Planned:
    facts: memory.ModelFacts
    setup: memory.Setup
    breakdown: memory.Breakdown


def planned(spec: JobSpec, profile: Profile, plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> Planned | str:
    """The job's memory plan, or why it cannot be made here."""
    why = unavailable(spec)
    if why is not None:
        return why
    setup = setup_of(spec, plan)
    facts = model_facts(spec, environ, gpu=setup.gpu)
    if setup.parallelism.pipeline > 1:  # the stages differ: the heaviest pipeline rank
        return Planned(facts, setup, memory_stages.estimate(facts, setup, capacity_of(profile)))
    return Planned(facts, setup, memory.estimate(facts, setup, capacity_of(profile)))


def with_memory(spec: JobSpec, profile: Profile, plan: LaunchPlan, environ: Mapping[str, str] | None = None,
                *, force: bool = False, source: str = "") -> LaunchPlan:
    """``plan`` with its ``memory``; a GPU job that does not fit is refused (UserError, exit 4: INVALID)
    unless ``force``."""
    try:
        got = planned(spec, profile, plan, environ)
    except Exception as exc:  # an architecture the trace cannot follow: said, never the end of validate
        got = (f"memory not estimated: tracing {spec.model.type or spec.model.pretrained} with fake tensors failed "
               f"({type(exc).__name__}: {str(exc)[:300]})")
    if isinstance(got, str):
        return dataclasses.replace(plan, notes=(*plan.notes, got))
    b = got.breakdown
    plan = dataclasses.replace(plan, memory=b.to_json())
    if got.setup.parallelism.pipeline > 1:  # the stages as the runtime splits this model
        stages = memory_stages.stage_map(got.facts, got.setup).describe()
        plan = dataclasses.replace(plan, notes=(*plan.notes, "pipeline stages: " + "; ".join(stages)))
    if b.fits is False:
        if not force:
            raise UserError(refusal(got, profile, source), exit_code=ExitCode.INVALID)
        plan = dataclasses.replace(plan, notes=(*plan.notes, f"memory: the planned peak {memory.gb(b.peak)} exceeds "
                                                f"{memory.gb(b.usable)} usable of the GPU's {profile.gpu_memory} (--force)"))
    if spec.checkpoint.async_save:
        plan = _with_host_staging(plan, got, force=force, source=source)
    return plan


def _with_host_staging(plan: LaunchPlan, got: Planned, *, force: bool, source: str) -> LaunchPlan:
    """The staged checkpoints' host buffers in the plan (``memory.host_staging``, a dry-run line),
    refused when they cannot fit the memory the job asks SLURM for per node (``resources.mem``):
    on a CPU job with the ranks' model states, which live in the same memory."""
    rows = got.breakdown.rows if got.setup.parallelism.pipeline > 1 else None
    tasks = plan.topology.tasks_per_node
    staging = host_memory.host_staging(got.facts, got.setup, tasks, rows)
    states = 0 if got.setup.gpu else tasks * sum(r.bytes for r in got.breakdown.rows if r.name in MODEL_STATE_ROWS)
    mem = plan.slurm.mem
    line = (f"host memory: staged checkpoints (checkpoint.async_save) hold {memory.gb(staging.per_node)} per node, "
            f"{memory.gb(staging.per_rank)} on the heaviest rank ({staging.how})")
    plan = dataclasses.replace(plan, memory={**(plan.memory or {}), "host_staging": staging.to_json()},
                               notes=(*plan.notes, line))
    if mem is None or staging.per_node + states <= mem_to_mb(mem) << 20:
        return plan
    what = f"{memory.gb(staging.per_node)} of staging buffers" + (
        f" beside {memory.gb(states)} of the node's ranks' model states (a CPU job's live in host memory)" if states else "")
    message = (f"{source + ': ' if source else ''}resources.mem {mem} per node cannot hold the staged checkpoints: "
               f"{what} (staged: {staging.how}). Ask for more (resources.mem), or set checkpoint.async_save: false "
               f"(every checkpoint written synchronously, holding training until it is durable)")
    if not force:
        raise UserError(message + " (--force submits anyway)", exit_code=ExitCode.INVALID)
    return dataclasses.replace(plan, notes=(*plan.notes, message.split(": ", 1)[-1] + " (--force)"))


def refusal(p: Planned, profile: Profile, source: str) -> str:
    b = p.breakdown
    lines = [f"{source + ': ' if source else ''}the planned peak per rank, {memory.gb(b.peak)}, does not fit the "
             f"GPU's {profile.gpu_memory} of profile '{profile.name}' ({memory.gb(b.usable)} usable: "
             f"{100 - int(memory.USABLE_FRACTION * 100)} % is kept for the allocator's fragmentation)", *table(b)]
    found = memory_fixes.fixes(p.facts, p.setup, b.capacity or 0) if p.setup.parallelism.pipeline == 1 else []
    if p.setup.parallelism.pipeline > 1:
        lines.append("a pipeline's fixes are not searched: more stages (trainer.pipeline_parallel_size), more "
                     "microbatches of fewer samples, activation checkpointing or more GPUs")
    elif found:
        lines.append("cheapest changes that fit, each alone:")
        for i, fix in enumerate(found[:6], 1):
            lines.append(f"  {i}. {' '.join(fix.overrides)}  -> {memory.gb(fix.breakdown.peak)}  ({fix.cost})")
    else:
        best = memory_fixes.best_fit(p.facts, p.setup, b.capacity or 0)
        if best is not None:
            lines.append(f"no single change fits; together: {' '.join(best.overrides)}  -> {memory.gb(best.breakdown.peak)}")
        else:
            lines.append("no combination of ZeRO stage, FSDP, micro batch, activation checkpointing and offload fits: "
                         "use more GPUs (resources.nodes) or a smaller model")
    lines.append("(`lmlaunch validate SPEC --fit` proposes the largest micro batch that fits; --force submits anyway)")
    return "\n".join(lines)


def table(b: memory.Breakdown) -> list[str]:
    """The breakdown as the CLI shows it."""
    width = max(len(r.name) for r in b.rows)
    out = [f"  {r.name:<{width}}  {memory.gb(r.bytes):>11}  {r.how}" for r in b.rows]
    tail = f"  {'peak per rank':<{width}}  {memory.gb(b.peak):>11}"
    if b.usable is not None:
        tail += f"  of {memory.gb(b.usable)} usable ({'fits' if b.fits else 'does NOT fit'})"
    return [*out, tail]


def proposal(p: Planned, profile: Profile) -> list[str]:
    """``validate --fit``: the largest micro batch that fits, keeping the global batch."""
    if p.breakdown.capacity is None:
        return ["fit: not a GPU job, or the profile has no gpu_memory: nothing to fit against"]
    best = memory_fixes.best_fit(p.facts, p.setup, p.breakdown.capacity)
    if best is None:
        return ["fit: nothing fits (any ZeRO stage or FSDP, micro batch 1, activation checkpointing, offload): "
                "use more GPUs (resources.nodes) or a smaller model"]
    head = (f"fit: {' '.join(best.overrides)}" if best.changes else "fit: as written (no larger micro batch fits)")
    return [f"{head}  -> {memory.gb(best.breakdown.peak)} of {memory.gb(best.breakdown.usable)} usable, "
            f"micro batch {dict(best.changes).get('data.micro_batch_size', p.setup.micro_batch)}, {best.cost}",
            *table(best.breakdown)]


def summary(plan_memory: dict[str, Any] | None) -> list[str]:
    """The plan.json's memory as table lines (the dry run)."""
    if not plan_memory:
        return []
    rows = tuple(memory.Row(**r) for r in plan_memory["rows"])
    return table(memory.Breakdown(rows, plan_memory.get("capacity")))
