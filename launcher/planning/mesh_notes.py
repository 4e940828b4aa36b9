"""What the plan's device mesh asks of the fabric and of the schedule, said in the dry run's notes:
tensor parallelism's collectives inside each node (and the NCCL presets that slow them), a
pipeline's schedule, its microbatches and the bubble they leave."""

from __future__ import annotations

from collections.abc import Mapping

from lmcore import pipeline_stages
from lmcore.plan import Topology

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
