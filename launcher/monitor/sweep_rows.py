"""A sweep in `status` and `sweep results`: one row for the whole sweep (points by state, the
best loss so far) and a table of every point's parameters against its losses (and, `--by`, an eval score). Pure."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from launcher.monitor.status_rows import StatusRow
from launcher.runs.registry import RunRecord
from lmcore.errors import UserError
from lmcore.slurm.client import state_word

# the group a sweep row takes: the liveliest of its points'
_GROUP_ORDER = ("running", "queued", "preempted", "failed", "timeout", "unknown", "cancelled", "completed")


def collapse(rows: Sequence[StatusRow], records: Sequence[RunRecord]) -> list[StatusRow]:
    """Rows of sweep points replaced by one row per sweep (at the place of its first point)."""
    out: list[StatusRow] = []
    by_sweep: dict[str, list[tuple[StatusRow, RunRecord]]] = {}
    for row, rec in zip(rows, records):
        if rec.sweep:
            if rec.sweep not in by_sweep:
                out.append(row)  # a placeholder, replaced below
            by_sweep.setdefault(rec.sweep, []).append((row, rec))
        else:
            out.append(row)
    first = {id(pts[0][0]): name for name, pts in by_sweep.items()}
    return [sweep_row(first[id(r)], [p for p, _ in by_sweep[first[id(r)]]]) if id(r) in first else r for r in out]


def sweep_row(name: str, points: Sequence[StatusRow]) -> StatusRow:
    states = Counter(state_word(p.state) for p in points)
    groups = {p.group for p in points}
    group = next((g for g in _GROUP_ORDER if g in groups), "unknown")
    losses = [(p.loss, p.name) for p in points if p.loss is not None and math.isfinite(p.loss)]
    best = min(losses) if losses else None
    note = f"sweep of {len(points)} points: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    note += (f"; best loss {best[0]:.4f} ({best[1]})" if best else "") + f"; `lmlaunch status {name}` lists them"
    return StatusRow(
        name=name, job_id=None, state=", ".join(f"{n} {s}" for s, n in sorted(states.items())), group=group,
        reason=None, requeued=False, nodes=None, elapsed=None, time_limit=None, attempt=0,
        step=sum(p.step or 0 for p in points), max_steps=sum(p.max_steps or 0 for p in points) or None,
        loss=best[0] if best else None, mfu=None,
        tokens_per_s=sum(p.tokens_per_s or 0 for p in points if p.group == "running") or None,
        checkpoint_step=None, checkpoint_age_s=None, eta_s=None, heartbeat_age_s=None, run_dir="",
        job_ids=[j for p in points for j in p.job_ids], note=note,
    )


def results(records: Sequence[RunRecord], finals: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per point: its parameters, final train loss, final and best validation loss, state.
    ``finals``: run name -> {"loss", "val_loss", "best_val_loss", "step", "state"}."""
    keys = sorted({k for r in records for k in r.point})
    out = []
    for r in records:
        f = finals.get(r.name, {})
        out.append({"run": r.name, **{k: r.point.get(k) for k in keys},
                    **{k: f.get(k) for k in ("state", "step", "loss", "val_loss", "best_val_loss")}})
    return out


_SEARCH_STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running",
                  "WAITING": "running"}


def search_rows(trials: Sequence[Mapping[str, Any]], run_name: Any, keys: Sequence[str],
                direction: str) -> list[dict[str, Any]]:
    """A search's trials in order: parameters, state (complete, pruned, failed, running), the
    objective, the step a pruned trial was stopped at (its last reported step), the best marked.
    ``trials``: {"number", "state" (Optuna's), "value", "params", "steps" (reported), "why"}."""
    done = [t for t in trials if t["state"] == "COMPLETE" and t["value"] is not None]
    pick = min if direction == "minimize" else max
    best = pick(done, key=lambda t: (t["value"], t["number"]) if direction == "minimize"
                else (t["value"], -t["number"]))["number"] if done else None
    rows = []
    for t in sorted(trials, key=lambda t: t["number"]):
        state = _SEARCH_STATES.get(t["state"], t["state"].lower())
        rows.append({"trial": t["number"], "run": run_name(t["number"]), **{k: t["params"].get(k) for k in keys},
                     "state": state, "objective": t["value"] if state in ("complete", "pruned") else None,
                     "pruned_at": t["steps"][-1] if state == "pruned" and t["steps"] else None,
                     "best": t["number"] == best, "why": t.get("why") if state != "complete" else None})
    return rows


# lm-eval metrics where lower is better (the rest: accuracies, F1, exact match, ... higher is better)
LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "loss", "ter", "error")


def ranked_by_eval(rows: list[dict[str, Any]], scores: Mapping[str, Sequence[Any]], by: str) -> list[dict[str, Any]]:
    """``sweep results --by TASK/METRIC``: each point's newest scored value of it as a column, the
    points best first (lower first for perplexities, bits per byte and losses), unscored ones last."""
    task, _, metric = by.partition("/")
    if not task or not metric:
        raise UserError(f"--by {by!r}: give TASK/METRIC, e.g. lmlaunch_pydoc_choice/acc")
    column = f"eval {by}"
    for row in rows:
        recs = sorted(scores.get(row["run"], ()), key=lambda r: r.step)
        values = [(r.step, s.get("value")) for r in recs for s in r.scores
                  if s.get("task") == task and s.get("metric") == metric and isinstance(s.get("value"), (int, float))]
        row[column] = values[-1][1] if values else None
        row["eval step"] = values[-1][0] if values else None
    if all(row[column] is None for row in rows):
        raise UserError(f"--by {by}: no point has a score of {by} (score them with `lmlaunch eval POINT --tasks {task}`)")
    lower = any(word in metric for word in LOWER_IS_BETTER)
    return sorted(rows, key=lambda row: (row[column] is None, (row[column] or 0) * (1 if lower else -1)))
