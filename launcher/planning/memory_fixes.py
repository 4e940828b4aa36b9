"""What to change when a job's planned peak does not fit its GPU (launcher.planning.memory's estimate):
the single changes that fit, cheapest first, and the combination with the largest micro batch that
fits (``validate --fit``). Pure: no torch, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from launcher.planning.memory import Breakdown, ModelFacts, Setup, estimate
from lmcore.job.parallelism import DataParallel


@dataclass(frozen=True)
class Fix:  # -- what to change when it does not fit
    changes: tuple[tuple[str, Any], ...]  # (spec key, new value)
    cost: str
    rank: int  # lower is cheaper
    breakdown: Breakdown

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changes]


_ZERO, _SHARD = DataParallel.ZERO.value, DataParallel.SHARD.value  # the spec's words, in the fixes' overrides
_STRATEGY_COST = "same communication volume as DDP (reduce-scatter and all-gather instead of all-reduce)"
_GATHER_COST = "~1.5x DDP's communication (parameters gathered in forward and again in backward)"
_MICRO_COST = "same tokens per step; smaller kernels, more micro steps"
_CKPT_COST = "~+33 % compute (each block's forward runs again in backward)"


def _single_changes(s: Setup) -> list[tuple[tuple[tuple[str, Any], ...], Setup, str, int]]:
    out: list[tuple[tuple[tuple[str, Any], ...], Setup, str, int]] = []
    par = s.parallelism
    if par.replicated:
        for stage in (1, 2):
            out.append(((("trainer.strategy", _ZERO), ("trainer.zero_stage", stage)),
                        s.on(par.with_data(DataParallel.ZERO, stage)), _STRATEGY_COST, 0))
        out.append(((("trainer.strategy", _SHARD),), s.on(par.with_data(DataParallel.SHARD)), _GATHER_COST, 2))
    if par.zero and (s.zero_stage or 0) < 3:
        for stage in range((s.zero_stage or 0) + 1, 4):
            out.append(((("trainer.zero_stage", stage),), s.on(par.with_data(DataParallel.ZERO, stage)),
                        _GATHER_COST if stage == 3 else _STRATEGY_COST, 2 if stage == 3 else 0))
    mb = s.micro_batch
    while mb > 1 and mb % 2 == 0:
        mb //= 2
        out.append(((("data.micro_batch_size", mb),), replace(s, micro_batch=mb),
                    f"{_MICRO_COST} (accumulation {s.global_batch // (mb * s.data_parallel)})", 1))
    if not s.checkpointing:
        out.append(((("model.activation_checkpointing", True),), replace(s, checkpointing=True), _CKPT_COST, 3))
    if par.zero and (s.zero_stage or 0) >= 2 and not s.offload_optimizer:
        out.append(((("trainer.offload_optimizer", True),), replace(s, offload_optimizer=True),
                    "the optimizer step on the CPU: PCIe transfers and CPU AdamW every step", 4))
    if par.zero and s.zero_stage == 3 and not s.offload_params:
        out.append(((("trainer.offload_params", True),), replace(s, offload_params=True),
                    "parameters cross PCIe for every forward and backward", 5))
    return out


def fixes(f: ModelFacts, s: Setup, capacity: int) -> list[Fix]:
    """Single changes that make the job fit, cheapest first (then the lowest peak)."""
    found = []
    for changes, setup, cost, rank in _single_changes(s):
        b = estimate(f, setup, capacity)
        if b.fits:
            found.append(Fix(changes, cost, rank, b))
    return sorted(found, key=lambda x: (x.rank, x.breakdown.peak))


def best_fit(f: ModelFacts, s: Setup, capacity: int) -> Fix | None:
    """The combination with the largest micro batch that fits, keeping the global batch: ZeRO
    stage or strategy, activation checkpointing, offload; among equal micro batches the cheapest."""
    par = s.parallelism
    strategies: list[tuple[tuple[tuple[str, Any], ...], dict[str, Any], int]] = [((), {}, 0)]
    if par.replicated:
        strategies += [((("trainer.strategy", _ZERO), ("trainer.zero_stage", z)),
                        {"parallelism": par.with_data(DataParallel.ZERO, z)}, 0 if z < 3 else 2) for z in (1, 2, 3)]
        strategies.append(((("trainer.strategy", _SHARD),), {"parallelism": par.with_data(DataParallel.SHARD)}, 2))
    elif par.zero:
        strategies += [((("trainer.zero_stage", z),), {"parallelism": par.with_data(DataParallel.ZERO, z)}, 0 if z < 3 else 2)
                       for z in range((s.zero_stage or 0) + 1, 4)]
    per_rank = s.global_batch // s.data_parallel
    micro = sorted({m for m in range(1, per_rank + 1) if per_rank % m == 0}, reverse=True)
    best: tuple[tuple[int, int, int], Fix] | None = None
    for mb in micro:
        for changes, update, cost in strategies:
            for ckpt in sorted({s.checkpointing, True}):
                for offload in (False, True):
                    setup = replace(s, micro_batch=mb, checkpointing=ckpt, **update)
                    if offload and not (setup.parallelism.zero and (setup.zero_stage or 0) >= 2):
                        continue
                    setup = replace(setup, offload_optimizer=setup.offload_optimizer or offload)
                    b = estimate(f, setup, capacity)
                    if not b.fits:
                        continue
                    rank = cost + (3 if ckpt and not s.checkpointing else 0) + (4 if offload and not s.offload_optimizer else 0)
                    all_changes = changes + ((("data.micro_batch_size", mb),) if mb != s.micro_batch else ()) \
                        + ((("model.activation_checkpointing", True),) if ckpt and not s.checkpointing else ()) \
                        + ((("trainer.offload_optimizer", True),) if offload and not s.offload_optimizer else ())
                    key = (-mb, rank, b.peak)
                    if best is None or key < best[0]:
                        best = (key, Fix(all_changes, f"accumulation {s.global_batch // (mb * s.data_parallel)}", rank, b))
        if best is not None:
            return best[1]
    return None
