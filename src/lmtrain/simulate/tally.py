"""What a scale-harness run did to its run directory, added up (pure reading; bench/scale.py and the
harness's test): the files it left by kind, every rank process's counters by phase, and the growth
law of a figure measured at several sizes.

A file's kind is its path with every number made ``N`` (``logs/attempt-N/rank-N.log``): the kinds
that grow with the ranks show by name.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.simulate.fs_count import PHASES, path_kind

OPS = ("open_write", "open_read", "stat", "listdir", "mkdir", "rename", "remove", "rmdir")


def kind_of(rel: str) -> str:
    return path_kind(rel)


def files_by_kind(run_dir: Path) -> Counter[str]:
    """Every file under ``run_dir`` now, counted by kind."""
    out: Counter[str] = Counter()
    for dirpath, _dirs, files in os.walk(run_dir):
        for name in files:
            out[kind_of((Path(dirpath) / name).relative_to(run_dir).as_posix())] += 1
    return out


@dataclass
class Counts:
    """Every counted process of a run: ``processes`` is each one's file (lmtrain.simulate.fs_count)."""

    processes: list[dict[str, Any]]

    @classmethod
    def read(cls, counts_dir: Path) -> Counts:
        return cls([json.loads(p.read_text()) for p in sorted(counts_dir.glob("*.json"))])

    def ranks_of(self, role: str = "task", **who: Any) -> set[int]:
        return {int(p["rank"]) for p in self.processes if p.get("role") == role and p.get("rank") is not None
                and all(p.get(k) == v for k, v in who.items())}

    def total(self, phase: str, op: str | None = None, *, role: str | None = None) -> int:
        n = 0
        for p in self.processes:
            if role is not None and p.get("role") != role:
                continue
            ops = (p.get("phases") or {}).get(phase) or {}
            n += sum(ops.values()) if op is None else int(ops.get(op, 0))
        return n

    def steps(self, kind: str) -> int:
        return sum(int((p.get("steps") or {}).get(kind, 0)) for p in self.processes)

    def paths(self, phase: str, *, role: str | None = None) -> Counter[str]:
        """``"op kind"`` -> n in ``phase``, summed over the processes."""
        out: Counter[str] = Counter()
        for p in self.processes:
            if role is None or p.get("role") == role:
                out.update((p.get("paths") or {}).get(phase) or {})
        return out

    def by_phase(self) -> dict[str, dict[str, int]]:
        """Every phase's operations, summed over the processes (agents included)."""
        out: dict[str, dict[str, int]] = {}
        for phase in [*PHASES, *sorted({p for q in self.processes for p in q.get("phases") or {}} - set(PHASES))]:
            row = {op: self.total(phase, op) for op in OPS}
            if any(row.values()):
                out[phase] = row
        return out


LAWS = ("flat", "per node", "per rank", "per node + per rank", "per rank squared")


def _fit(xs: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    """Least squares of ys on the columns xs (with a constant); (coefficients, worst relative error)."""
    import numpy as np

    a = np.column_stack([np.ones(len(ys)), *[np.asarray(x, dtype=float) for x in xs]])
    y = np.asarray(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    fitted = a @ coef
    err = float(max(abs(f - v) / max(abs(v), 1.0) for f, v in zip(fitted, y, strict=True)))
    return [float(c) for c in coef], err


def growth_law(sizes: Sequence[tuple[int, int]], values: Iterable[float], *, tolerance: float = 0.1) -> dict[str, Any]:
    """The simplest law that fits ``values`` measured at ``sizes`` ((ranks, nodes) each) within
    ``tolerance`` (relative): ``{"law", "coefficients", "error"}``. Coefficients: the constant, then
    per node and/or per rank (or per rank squared). Needs sizes whose ranks per node differ to tell a
    per-node cost from a per-rank one."""
    ys = [float(v) for v in values]
    ranks = [float(r) for r, _ in sizes]
    nodes = [float(n) for _, n in sizes]
    candidates = {"flat": [], "per node": [nodes], "per rank": [ranks], "per node + per rank": [nodes, ranks],
                  "per rank squared": [[r * r for r in ranks]]}
    best: dict[str, Any] | None = None
    for law in LAWS:
        coef, err = _fit(candidates[law], ys)
        row = {"law": law, "coefficients": [round(c, 3) for c in coef], "error": round(err, 4)}
        if err <= tolerance:
            return row
        if best is None or err < best["error"]:
            best = row
    assert best is not None
    return {**best, "law": f"{best['law']} (nearest; no law within {tolerance:.0%})"}


def extrapolate(law: dict[str, Any], ranks: int, nodes: int) -> float:
    """A law's value at another size."""
    c = law["coefficients"]
    name = law["law"].split(" (")[0]
    terms = {"flat": [], "per node": [nodes], "per rank": [ranks], "per node + per rank": [nodes, ranks],
             "per rank squared": [ranks * ranks]}[name]
    return c[0] + sum(k * x for k, x in zip(c[1:], terms, strict=True))
