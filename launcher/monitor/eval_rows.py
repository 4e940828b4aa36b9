"""What status, history, the exporter and the dashboard say about the evaluator alongside a run
(``eval.alongside``), from its files (lmcore.run.eval_alongside: ``eval/scores.jsonl``, its state, its
srun's exit status). Pure but for :func:`read_evaluation`, which reads them."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcore.run import eval_alongside as ev

SHOWN = 4  # metrics in a status note (status --json and history have all)


@dataclass(frozen=True)
class Evaluation:
    """One run's evaluator, as its files say."""

    records: list[ev.CheckpointScores] = field(default_factory=list)  # every scored checkpoint, or the newest
    state: dict[str, Any] | None = None
    exit: tuple[str, int, float, bool] | None = None  # job id, its srun's exit status, when, stopped by the job
    scored: int | None = None  # how many checkpoints are scored, where ``records`` holds only the newest

    @property
    def exists(self) -> bool:
        return bool(self.records or self.state or self.exit)

    @property
    def count(self) -> int:
        return self.scored if self.scored is not None else len(self.records)

    def to_json(self) -> dict[str, Any]:
        """Compact, for the status cache: the newest record only, and the count."""
        newest = max(self.records, key=lambda r: r.step, default=None)
        return {"newest": newest.to_json() if newest else None, "scored": self.count, "state": self.state,
                "exit": list(self.exit) if self.exit else None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Evaluation:
        n = d.get("newest")
        newest = [ev.CheckpointScores(**{**n, "scores": tuple(n["scores"]), "tasks": tuple(n.get("tasks") or ())})] \
            if n else []
        x = d.get("exit")
        return cls(newest, d.get("state"), (str(x[0]), int(x[1]), float(x[2]), bool(x[3])) if x else None,
                   int(d["scored"]))


def read_evaluation(run_dir: str | Path) -> Evaluation:
    return Evaluation(ev.read_scores(run_dir), ev.read_state(run_dir), ev.read_exit(run_dir))


def exit_words(rc: int) -> str:
    """srun's exit status as what happened: 137 -> 'killed (SIGKILL: the OOM killer, or kill -9)'."""
    if rc > 128:
        try:
            name = signal.Signals(rc - 128).name
        except ValueError:
            return f"exited {rc}"
        why = {"SIGKILL": ": the OOM killer, or kill -9", "SIGTERM": ": the job was stopped, preempted or requeued"}
        return f"killed ({name}{why.get(name, '')})"
    return f"exited {rc}"


def trouble(e: Evaluation) -> str | None:
    """What went wrong with the evaluator this attempt (training goes on regardless); None: nothing."""
    state = e.state or {}
    at = f" while scoring step {state['step']}" if state.get("state") == "scoring" and state.get("step") is not None \
        else ""
    if state.get("state") == "failed":
        return f"evaluator failed at step {state.get('step')}: {state.get('detail')} (`lmlaunch logs RUN --errors`)"
    # stopped: the job ended it (a preemption, a requeue, a cancel, finish_wait_s over), not a fault of its own
    if e.exit is not None and e.exit[1] != 0 and not e.exit[3] and state.get("state") != "done":
        return f"evaluator {exit_words(e.exit[1])}{at}; training goes on (`lmlaunch logs RUN --errors`)"
    return None


def summary(e: Evaluation) -> dict[str, Any] | None:
    """``status --json``'s ``eval``: the newest scored step and its metrics, the count, the state."""
    if not e.exists:
        return None
    latest = ev.latest_scores(e.records)
    return {"scored": e.count, "latest": latest, "state": (e.state or {}).get("state"),
            "step": (e.state or {}).get("step"), "trouble": trouble(e)}


def note(e: Evaluation, run: str) -> str:
    """The status note: the newest scores (a few metrics), then what went wrong, if anything."""
    parts = []
    latest = ev.latest_scores(e.records)
    if latest:
        shown = list(latest["scores"].items())[:SHOWN]
        more = len(latest["scores"]) - len(shown)
        parts.append(f"eval step {latest['step']}: " + ", ".join(f"{k} {_num(v)}" for k, v in shown)
                     + (f" (+{more} more: `lmlaunch history {run}`)" if more > 0 else ""))
    elif (e.state or {}).get("state") in ("scoring", "downloading"):  # downloading: from the run's bucket
        parts.append(f"evaluator {(e.state or {})['state']} step {(e.state or {}).get('step')}")
    bad = trouble(e)
    if bad:
        parts.append(bad.replace("RUN", run))
    return "; ".join(parts)


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)


def table(e: Evaluation) -> list[list[str]]:
    """history's eval section: one row per scored checkpoint and metric (step, task, metric, value ± stderr)."""
    rows = []
    for r in sorted(e.records, key=lambda r: r.step):
        for s in r.scores:
            err = s.get("stderr")
            value = _num(s.get("value")) + (f" ± {err:.2g}" if isinstance(err, (int, float)) else "")
            rows.append([str(r.step), str(s.get("task")), str(s.get("metric")), value, r.job_id])
    return rows
