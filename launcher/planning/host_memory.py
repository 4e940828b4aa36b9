"""Host memory a training job holds beside the accelerator's (pure: no torch, no I/O): the staged
checkpoints' buffers (``checkpoint.async_save``: lmtrain.checkpoint.async_checkpoint reserves them at
the attempt's first step and keeps them for the attempt), per rank and per node, from the same model
states launcher.planning.memory plans for the accelerator. launcher.planning.memory_check puts them in
the plan and refuses a job whose ``resources.mem`` cannot hold them. :func:`node_memory_problem`: the
memory a job asks per node against what the profile's nodes have (``mem_per_node``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from launcher.planning.memory import ModelFacts, Row, Setup, model_states


@dataclass(frozen=True)
class HostStaging:
    """Host memory of the staged checkpoints (``checkpoint.async_save``: periodic and stop saves
    copy each rank's part into host buffers reserved at the attempt's first step, held for the
    attempt): the heaviest rank's and the heaviest node's bytes."""

    per_rank: int
    per_node: int
    how: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def host_staging(f: ModelFacts, s: Setup, tasks_per_node: int, rows: Sequence[Row] | None = None) -> HostStaging:
    """What a staged save copies into host memory (lmtrain.checkpoint.async_checkpoint, async_sharded):
    DDP's rank 0 the whole state (weights and AdamW moments, fp32); FSDP2 every rank its shards;
    DeepSpeed every rank its optimizer partition (fp32 master weights and moments), ZeRO-1/2's rank
    0 also the module state (the weights in the compute dtype). Offloaded states are staged too
    (they are written from the host copy). ``rows``: a pipeline stage's model states (the heaviest
    stage, launcher.planning.memory_stages), else the whole model's."""
    if rows is None:
        rows = model_states(f, replace(s, offload_optimizer=False, offload_params=False))
    by = {r.name: r.bytes for r in rows}
    params, opt = by.get("parameters", 0), by.get("optimizer states", 0)
    n = max(1, tasks_per_node)
    if s.parallelism.zero:
        if s.zero_stage == 3:
            return HostStaging(opt, n * opt, f"every rank its optimizer partition, {n} rank(s) per node (ZeRO-3)")
        return HostStaging(params + opt, params + n * opt,
                           f"every rank its optimizer partition; rank 0 also the module state (ZeRO-{s.zero_stage})")
    if s.parallelism.fsdp or s.parallelism.pipeline > 1 or s.tensor_parallel > 1:
        return HostStaging(params + opt, n * (params + opt), f"every rank its own shards, {n} rank(s) per node")
    return HostStaging(params + opt, params + opt, "rank 0 alone: the whole state (weights and AdamW moments)")


def node_memory_problem(mem: str | None, asked: str | None, profile_name: str, mem_per_node: str | None,
                        derived: str = "") -> str | None:
    """Why the job's memory per node (``mem``: ``asked`` from resources.mem, else ``derived``, how the
    profile's default made it) is more than a node of the profile has (``mem_per_node``); None when it
    fits or either is unknown. SLURM queues such a job and never starts it."""
    from lmcore.job.spec import mem_to_mb

    if mem is None or mem_per_node is None or mem_to_mb(mem) <= mem_to_mb(mem_per_node):
        return None
    what = f"resources.mem({asked})" if asked else f"the job's memory per node, {derived} = {mem},"
    return (f"{what} is above the {mem_per_node} a node of profile '{profile_name}' has (mem_per_node): SLURM "
            f"would never start the job; ask {mem_per_node} or less"
            + ("" if asked else " (set resources.mem, or correct the profile's mem_per_gpu)"))
