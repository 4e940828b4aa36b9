"""What the plan's device mesh asks of the fabric and of the schedule, said in the dry run's notes:
tensor parallelism's collectives inside each node (and the NCCL presets that slow them), a
pipeline's schedule, its microbatches and the bubble they leave, FSDP2 sharding over one rank."""

from __future__ import annotations

from collections.abc import Mapping

from lmcore.job import pipeline_stages
from lmcore.job.plan import Topology

# NCCL settings that take the intra-node path tensor parallelism depends on off the fast links
_TP_SLOW_PATHS = {
    "NCCL_P2P_DISABLE": ("1", "peer-to-peer between the node's GPUs is off: every TP all-reduce goes through host memory"),
    "NCCL_SHM_DISABLE": ("1", "shared memory between the node's processes is off"),
    "NCCL_P2P_LEVEL": ("LOC", "peer-to-peer is restricted to the same GPU: TP all-reduces go through host memory"),
}


def tensor_parallel(topo: Topology, env: Mapping[str, str], reasons: Mapping[str, str]) -> tuple[str, ...]:
    """What tensor parallelism needs of NCCL inside the node: an all-reduce (or gather and
    scatter) per block in forward and backward, over the node's NVLink/NVSwitch peer-to-peer
    path; the presets that take that path away, said with their reasons."""
    if topo.parallelism.tensor == 1 or topo.accelerator != "gpu":
        return ()
    notes = [f"tensor_parallel({topo.parallelism.tensor}) runs its collectives inside each node, twice per "
             f"block per step: they need NCCL's peer-to-peer path over NVLink/NVSwitch"
             + (" (NCCL_NVLS_ENABLE=1: NVLink SHARP serves them)" if env.get("NCCL_NVLS_ENABLE") == "1" else "")]
    for name, (bad, what) in _TP_SLOW_PATHS.items():
        if env.get(name) == bad:
            notes.append(f"{name}={bad} ({reasons.get(name, 'planned')}): {what}; tensor parallelism will be slow")
    return tuple(notes)


def pipeline(topo: Topology) -> tuple[str, ...]:
    """The pipeline's turns: schedule, microbatches, the bubble; its point-to-point traffic."""
    par = topo.parallelism
    if par.pipeline == 1:
        return ()
    v = pipeline_stages.stages_per_rank(par.schedule)
    split = (f"layers per stage {list(par.split)}" if par.split is not None else
             "layers balanced over the stages by parameter count (the embedding on the first, the norm and head on the last)")
    return (f"pipeline_parallel({par.pipeline}), schedule {par.schedule}: {par.pipeline * v} stages ({v} a rank), "
            f"{par.microbatches} microbatches of {topo.micro_batch_size} per step and replica; "
            f"{pipeline_stages.bubble_text(par.schedule, par.pipeline, par.microbatches)}; {split}; "
            f"stages pass activations point to point (send/recv), no collective across them",)


def sharding(topo: Topology) -> tuple[str, ...]:
    """FSDP2 whose shard group is one rank (one GPU, or every rank a tensor-parallel part): it
    shards nothing, and still gathers and reduces every block each step."""
    par = topo.parallelism
    if not par.fsdp or par.data_parallel_size > 1 or par.pipeline > 1:  # a pipeline's stages are not FSDP2 groups
        return ()
    alone = ("trainer.strategy fsdp on one rank" if par.tensor == 1 else
             f"FSDP2's data-parallel dimension is 1 (all {par.world_size} ranks are one tensor-parallel group)")
    return (f"{alone}: FSDP2 shards over one rank, which saves no memory, and still gathers each block before its "
            f"forward and reduces its gradients after its backward, every step (on a CPU, GPT-2's 13 groups cost "
            f"about 16 ms of a 78-99 ms step: bench/throughput.py --config host-fsdp)"
            + ("; trainer.strategy ddp trains the same model on one rank without them" if par.tensor == 1 else ""),)
