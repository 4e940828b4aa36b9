"""Which rank is slow: a pure scorer of the ranks' step timing (lmtrain.observe.rank_timing).

Input: one row per scored interval, one column per rank, each cell the rank's compute seconds
per optimizer step in that interval (its ``forward_s`` over its steps: the part of a step with
no collective under DDP, so a fast rank's waits for a slow one do not count; a scored interval
is one or more logging intervals, lmtrain.health.straggler_watch). A rank is slow

- **against its peers** when its compute is above ``threshold`` x the median of the *other*
  ranks in each of the last ``window`` intervals (the factor said is the smallest of those
  ratios: it held at least that much all along). The others' median, not all ranks': with 2
  ranks the median of both would need a rank 3x slower to reach 1.5x;
- **against itself** when its compute is above ``threshold`` x its own median over the earlier
  intervals of the attempt (at least ``window`` of them) in each of the last ``window``
  intervals: a rank that slowed down while its peers slowed as much (a shared filesystem, a
  thermal event across the job) is not a straggler by the first rule but is by this one.

A rank is no longer slow when neither holds. Missing cells (a rank that has not written that
interval) are NaN and never make a rank slow. numpy over the whole table: 8,192 ranks x a
window of intervals is scored in milliseconds (tests/unit/test_stragglers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcore.run.straggler_lines import PEERS, SELF


@dataclass(frozen=True)
class StragglerPolicy:
    threshold: float = 1.5
    window: int = 3

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"health.stragglers.threshold({self.threshold}) must be above 1")
        if self.window < 1:
            raise ValueError(f"health.stragglers.window({self.window}) must be at least 1")


@dataclass(frozen=True)
class Slow:
    """A rank found slow: ``factor`` x the median of its peers (``against`` "peers") or of its own
    earlier intervals ("self"), held for the whole window."""

    rank: int
    factor: float
    against: str


def score(compute: np.ndarray, policy: StragglerPolicy) -> list[Slow]:
    """The slow ranks of a table ``compute[interval, rank]`` (seconds per step; NaN where missing),
    worst first. Pure."""
    table = np.asarray(compute, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < policy.window or table.shape[1] == 0:
        return []
    recent = table[-policy.window:]
    found: dict[int, Slow] = {}
    if table.shape[1] > 1:
        others = np.vstack([others_median(row) for row in recent])
        _flag(found, _ratio(recent, others), policy.threshold, PEERS)
    earlier = table[:-policy.window]
    if earlier.shape[0] >= policy.window:
        _flag(found, _ratio(recent, own_median(earlier)), policy.threshold, SELF)
    return sorted(found.values(), key=lambda s: (-s.factor, s.rank))


def others_median(row: np.ndarray) -> np.ndarray:
    """For each rank of a row, the median of the other ranks' values (NaN where missing). One sort:
    the k-th smallest of the others is the row's k-th, or its (k+1)-th for a rank at or below k."""
    out = np.full(row.shape, np.nan)
    present = ~np.isnan(row)
    values = row[present]
    n = values.size
    if n < 2:
        return out
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)

    def kth_of_others(k: int) -> np.ndarray:
        return np.where(position <= k, ranked[min(k + 1, n - 1)], ranked[k])

    m = n - 1
    median = kth_of_others(m // 2) if m % 2 else (kth_of_others(m // 2 - 1) + kth_of_others(m // 2)) / 2
    out[present] = median
    return out


def own_median(earlier: np.ndarray) -> np.ndarray:
    """Each rank's median over the earlier intervals (NaN for a rank with none), as a row."""
    out = np.full((1, earlier.shape[1]), np.nan)
    seen = ~np.all(np.isnan(earlier), axis=0)
    if seen.any():
        out[0, seen] = np.nanmedian(earlier[:, seen], axis=0)
    return out


def _ratio(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = values / reference
    return np.where(np.isfinite(ratio), ratio, 0.0)  # missing or a zero reference: never slow


def _flag(found: dict[int, Slow], ratio: np.ndarray, threshold: float, against: str) -> None:
    held = ratio.min(axis=0)  # over the window: slow in every interval of it
    for rank in (int(r) for r in np.flatnonzero(held > threshold)):
        factor = round(float(held[rank]), 2)
        if rank not in found or found[rank].factor < factor:
            found[rank] = Slow(rank=rank, factor=factor, against=against)


def line_figures(line: Mapping[str, Any]) -> tuple[float, int, float]:
    """What a timing line gives the scorer: (forward seconds, optimizer steps, wall seconds)."""
    return float(line.get("forward_s") or 0.0), max(int(line.get("steps") or 1), 1), float(line.get("wall_s") or 0.0)
