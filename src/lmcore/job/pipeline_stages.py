"""Pipeline parallelism, planned without torch: which schedule, how many stages each rank holds,
how the model's blocks are split over the stages, and the bubble the schedule leaves.

The runtime (``lmtrain.model.pipeline``) builds the stages from the same split and runs the schedule
with ``torch.distributed.pipelining``; the dry run shows the stage map and the bubble from here.
Bubble fractions (idle time over compute time per step, torchtitan and the papers): GPipe and 1F1B
``(p-1)/m``, interleaved 1F1B with ``v`` stages a rank ``(p-1)/(v m)``, zero-bubble schedules close
to 0 (they split each backward into its input and weight halves to fill the gaps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcore.job.parallelism import Parallelism
    from lmcore.job.spec import TrainerSpec

# trainer.pipeline_schedule -> (torch.distributed.pipelining class, stages per rank)
SCHEDULES: dict[str, tuple[str, int]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2),
}

def stages_per_rank(schedule: str) -> int:
    return SCHEDULES[schedule][1]


def bubble(schedule: str, pipeline: int, microbatches: int) -> float:
    """Idle time over compute time of one step: ``(p-1)/(v m)``, 0 for a zero-bubble schedule
    (ideally; its warm-up still idles a little)."""
    if pipeline == 1 or "zero_bubble" in schedule:
        return 0.0
    return (pipeline - 1) / (stages_per_rank(schedule) * microbatches)


def bubble_text(schedule: str, pipeline: int, microbatches: int) -> str:
    v = stages_per_rank(schedule)
    if "zero_bubble" in schedule:
        return f"bubble close to 0 ({schedule}: each backward split into its input and weight halves)"
    formula = f"(p-1)/m = ({pipeline}-1)/{microbatches}" if v == 1 else \
        f"(p-1)/(v m) = ({pipeline}-1)/({v} x {microbatches})"
    return f"bubble {formula} = {bubble(schedule, pipeline, microbatches):.0%} of the step's compute"


@dataclass(frozen=True)
class StageMap:
    """Stage ``s`` holds decoder layers ``layers[s]`` (a half-open range); stage 0 also the
    embedding, the last stage the final norm and the head. Rank ``r`` of the pipeline holds
    stages ``r, r + p, r + 2p, ...`` (torch's loop placement)."""

    layers: tuple[tuple[int, int], ...]
    pipeline: int

    def stages_of(self, pipeline_rank: int) -> list[int]:
        return list(range(pipeline_rank, len(self.layers), self.pipeline))

    def describe(self) -> list[str]:
        out = []
        last = len(self.layers) - 1
        for s, (lo, hi) in enumerate(self.layers):
            parts = (["embedding"] if s == 0 else []) + [f"layers {lo}-{hi - 1}" if hi - lo > 1 else f"layer {lo}"] + (
                ["norm, head"] if s == last else [])
            out.append(f"stage {s} (pipeline rank {s % self.pipeline}): {', '.join(parts)}")
        return out


def split_layers(block_costs: list[int], pipeline: int, schedule: str, *, first_extra: int = 0, last_extra: int = 0,
                 explicit: list[int] | None = None) -> StageMap | str:
    """Contiguous layers per stage, every stage at least one: ``explicit`` (layers per stage, as
    the spec gives them) or the split whose largest stage (parameters, the embedding counted on the
    first stage and the norm and head on the last) is smallest. A string: why it cannot be split."""
    n, stages = len(block_costs), pipeline * stages_per_rank(schedule)
    if explicit is not None:
        if len(explicit) != stages or sum(explicit) != n or min(explicit) < 1:
            return (f"trainer.pipeline_split {explicit} must give each of the {stages} stages at least one layer and "
                    f"add up to the model's {n} layers")
        bounds, lo = [], 0
        for k in explicit:
            bounds.append((lo, lo + k))
            lo += k
        return StageMap(tuple(bounds), pipeline)
    if stages > n:
        return (f"trainer.pipeline_parallel_size({pipeline}) x {stages // pipeline} stage(s) per rank ({schedule}) = "
                f"{stages} stages need at least {stages} layers; the model has {n}")
    return StageMap(_balanced(block_costs, stages, first_extra, last_extra), pipeline)


def _balanced(costs: list[int], stages: int, first: int, last: int) -> tuple[tuple[int, int], ...]:
    """Minimise the largest stage's cost over contiguous splits (dynamic programming; n <= a few hundred)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first if s == 0 else 0) + (last if s == stages - 1 else 0)

    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost of layers [0, i) over stages [0, s]
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], cost(s, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, hi = [], n
    for s in range(stages - 1, 0, -1):
        lo = cut[s][hi]
        bounds.append((lo, hi))
        hi = lo
    bounds.append((0, hi))
    return tuple(reversed(bounds))


def microbatch_size(trainer: TrainerSpec, micro_batch: int, data_parallel: int, problems: list[str]) -> int:
    """The microbatch size of a pipeline: ``data.micro_batch_size``, or what
    ``trainer.pipeline_microbatches`` makes of each replica's share of the global batch."""
    m = trainer.pipeline_microbatches
    if m is None:
        return micro_batch
    share, gbs = trainer.global_batch_size // data_parallel, trainer.global_batch_size
    if gbs % data_parallel or share % m:
        problems.append(f"trainer.pipeline_microbatches({m}) must divide each replica's share of the global batch, "
                        f"trainer.global_batch_size({gbs}) / data_parallel({data_parallel}) = {gbs / data_parallel:g} "
                        f"samples, into whole microbatches")
        return micro_batch
    return share // m


def schedule_problems(par: Parallelism, split: list[int] | None, model_type: str | None,
                      config: Mapping[str, Any]) -> list[str]:
    """What the schedule and the model's blocks need of the planned pipeline ``par`` (the layer
    count where the spec gives it; the runtime checks a pretrained model's)."""
    pp, schedule, microbatches, out = par.pipeline, par.schedule, par.microbatches, []
    v = stages_per_rank(schedule)
    if schedule != "gpipe" and microbatches < pp:
        out.append(f"trainer.pipeline_schedule {schedule} needs at least trainer.pipeline_parallel_size({pp}) "
                   f"microbatches per step, one in flight on every stage; it has {microbatches} (global_batch / "
                   f"(data_parallel x microbatch size)): raise trainer.global_batch_size or trainer.pipeline_microbatches")
    if "zero_bubble" in schedule and par.shards_stages:
        out.append(f"trainer.pipeline_schedule {schedule} with data_parallel({par.data_parallel_size}) x "
                   f"tensor_parallel({par.tensor}): "
                   "FSDP2 shards the stages then, and it reduces each stage's gradients before the schedule's separate "
                   "weight backward has run (measured: losses off DDP's by 0.02); use interleaved_1f1b, or one plain "
                   "replica (world_size = pipeline_parallel_size)")
    rounds = max(1, microbatches // pp)
    if v > 1 and microbatches % rounds:
        out.append(f"trainer.pipeline_schedule {schedule} runs microbatches in rounds of trainer.pipeline_parallel_size({pp}): "
                   f"{microbatches} microbatches do not fill {rounds} whole rounds; use a multiple of {pp}")
    return out + model_problems(pp, schedule, split, model_type, config)


def model_problems(pp: int, schedule: str, split: list[int] | None, model_type: str | None,
                   config: Mapping[str, Any], pretrained: str | None = None) -> list[str]:
    """What a pipeline needs of the model's size (enough layers for its stages): from the spec's
    ``model`` section, or from a pretrained directory's config.json (``pretrained``: its path). Its
    structure (one list of blocks, a final norm) is checked on the model itself
    (lmtrain.model.pipeline.problems: launcher.planning.model_check, and the runtime)."""
    out, v = [], stages_per_rank(schedule)
    def key(k: str) -> str:
        if pretrained is None:
            return f"model.{k}"
        return f"model.pretrained's config.json ({pretrained}): " + ("model_type" if k == "type" else k.split(".")[-1])

    layers = config.get("num_hidden_layers", config.get("n_layer"))  # GPT-2 names it n_layer
    if isinstance(layers, int):
        got = split_layers([1] * layers, pp, schedule, explicit=list(split) if split is not None else None)
        if isinstance(got, str):
            out.append(got)
        elif v > 1 and split is None and layers % (pp * v):
            out.append(f"trainer.pipeline_schedule {schedule}: {key('config.num_hidden_layers')}({layers}) is not "
                       f"divisible by trainer.pipeline_parallel_size({pp}) x {v} stages per rank = {pp * v}; equal "
                       f"stages keep the interleaving's turns even (or give trainer.pipeline_split)")
    return out
