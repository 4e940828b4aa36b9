"""Per-rank memory of a pipeline (pure): the heaviest pipeline rank's breakdown.

The stages differ: the first holds the embedding, the last the final norm, the head and the
logits; and each rank keeps the activations of the microbatches it has run forward and not yet
backward. :func:`estimate` takes the stage map the runtime builds (:func:`lmcore.
pipeline_stages.split_layers` over the same parameter counts), restricts the model's facts to each
pipeline rank's stages, estimates that rank with :mod:`launcher.planning.memory` (FSDP2 over the data
dimension, tensor parallelism inside the node), scales the activations to its layers and its
microbatches in flight, and returns the rank with the largest peak, saying which it is.

Microbatches in flight on pipeline rank ``r`` of ``p`` (``m`` per step, ``v`` stages a rank):
GPipe runs every forward before any backward (``m``); 1F1B starts backward after ``p - r``
forwards (``min(m, p - r)``); the interleaved schedules run ``(v-1) p + 2 (p-1-r) + 1`` stage
forwards before their first backward (at most ``v m``), each of one stage's layers.
"""

from __future__ import annotations

import math
from dataclasses import replace

from launcher.planning import memory
from launcher.planning.memory import Breakdown, ModelFacts, Row, Setup
from lmcore.job import pipeline_stages

# the rows of one plain replica's stages: FSDP2 does not shard them (Parallelism.shards_stages)
_UNSHARDED = {
    "parameters": "fp32, whole, this rank's stages",
    "gradients": "fp32, whole",
    "optimizer states": "AdamW moments fp32, whole",
    "communication buffers": "one replica: its stages are not sharded (lmcore.job.parallelism: shards_stages)",
}


def in_flight(schedule: str, pipeline: int, microbatches: int, rank: int) -> int:
    """Stage forwards whose activations pipeline rank ``rank`` holds at once (see the module docstring)."""
    v = pipeline_stages.stages_per_rank(schedule)
    if schedule == "gpipe":
        return microbatches
    if v == 1:
        return min(microbatches, pipeline - rank)
    return min(v * microbatches, (v - 1) * pipeline + 2 * (pipeline - 1 - rank) + 1)


def _stage_params(f: ModelFacts, layers: list[tuple[int, int]], first: bool, last: bool) -> tuple[int, ...]:
    """Indices of the parameters a rank holds: its blocks' and, outside the blocks, the ones
    before the first block (the embedding) on the first stage and after it (norm, head) on the last."""
    first_block = next((i for i, p in enumerate(f.params) if p[3] >= 0), len(f.params))
    keep = []
    for i, p in enumerate(f.params):
        if p[3] >= 0:
            if any(lo <= p[3] < hi for lo, hi in layers):
                keep.append(i)
        elif (i < first_block and first) or (i > first_block and last):
            keep.append(i)
    if last and f.tied_head >= 0 and f.tied_head not in keep:
        keep.append(f.tied_head)  # the head tied to the embedding: a copy of it on the last stage
    return tuple(keep)


def _rank_breakdown(f: ModelFacts, s: Setup, smap: pipeline_stages.StageMap, rank: int,
                    capacity: int | None) -> Breakdown:
    par = s.parallelism
    stages = smap.stages_of(rank)
    layers = [smap.layers[i] for i in stages]
    first, last = 0 in stages, len(smap.layers) - 1 in stages
    keep = _stage_params(f, layers, first, last)
    held = replace(f, params=tuple(f.params[i] for i in keep),
                   tp_dims=tuple(f.tp_dims[i] for i in keep) if f.tp_dims else ())
    whole = memory.estimate(held, s, capacity)  # one microbatch's trace, of the whole model's layers
    n_layers = sum(hi - lo for lo, hi in layers)
    flight = in_flight(par.schedule, par.pipeline, par.microbatches, rank)
    fraction = n_layers / max(f.blocks, 1) / max(len(stages), 1)  # one stage's share, per stage forward
    rows = []
    for row in whole.rows:
        if row.name == "activations":
            rows.append(Row(row.name, math.ceil(row.bytes * fraction * flight),
                            f"{row.how}; {n_layers} of {f.blocks} layers, {flight} stage forward(s) in flight "
                            f"({par.schedule})"))
        elif row.name == "logits and loss" and not last:
            rows.append(Row(row.name, 0, "the last stage's (another pipeline rank)"))
        elif not par.shards_stages and row.name in _UNSHARDED:  # one plain replica (Parallelism.shards_stages)
            rows.append(Row(row.name, 0 if row.name == "communication buffers" else row.bytes, _UNSHARDED[row.name]))
        else:
            rows.append(row)
    names = "; ".join(d.split(": ", 1)[1] for d in smap.describe() if int(d.split()[1]) in stages)
    which = f"pipeline rank {rank} of {par.pipeline} ({names})"
    rows[0] = Row(rows[0].name, rows[0].bytes, f"{which}: {rows[0].how}")  # which rank, said once
    return Breakdown(tuple(rows), whole.capacity)


def estimate(f: ModelFacts, s: Setup, capacity: int | None = None) -> Breakdown:
    """The heaviest pipeline rank's breakdown (its first row says which rank it is)."""
    return max(per_rank(f, s, capacity), key=lambda b: b.peak)


def stage_map(f: ModelFacts, s: Setup) -> pipeline_stages.StageMap:
    """The runtime's split of this model (lmtrain.model.pipeline.stage_map over the same counts)."""
    par = s.parallelism
    costs = [sum(p[0] for p in f.params if p[3] == b) for b in range(f.blocks)]
    first_block = next((i for i, p in enumerate(f.params) if p[3] >= 0), len(f.params))
    before = sum(p[0] for i, p in enumerate(f.params) if p[3] < 0 and i < first_block)
    after = sum(p[0] for i, p in enumerate(f.params) if p[3] < 0 and i > first_block)
    after += f.params[f.tied_head][0] if f.tied_head >= 0 else 0  # the tied head's copy (lmtrain.model.pipeline)
    smap = pipeline_stages.split_layers(costs, par.pipeline, par.schedule, first_extra=before, last_extra=after,
                                        explicit=list(par.split) if par.split is not None else None)
    if isinstance(smap, str):
        raise ValueError(smap)
    return smap


def per_rank(f: ModelFacts, s: Setup, capacity: int | None = None) -> list[Breakdown]:
    """Each pipeline rank's breakdown (index: the rank's place in the pipeline)."""
    smap = stage_map(f, s)
    return [_rank_breakdown(f, s, smap, r, capacity) for r in range(s.parallelism.pipeline)]
