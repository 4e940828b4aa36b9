"""Scoring checkpoints alongside the training (``eval.alongside``): the evaluator's plan, its
records, and which checkpoint it scores next.

The trainer and the evaluator are one SLURM heterogeneous job (launcher.submit.script renders its
second component and the evaluator's srun); the evaluator (lmtrain.evaluator) scores each complete
checkpoint with lm-evaluation-harness and appends one line per checkpoint to the run's
``eval/scores.jsonl``, all of that checkpoint's tasks in one write: a checkpoint is in the records
whole or not at all, so an evaluator killed mid-checkpoint (a preemption, a crash) scores it again
after the requeue and never twice. Pure and torch-free: the planner, the script's renderer, the
evaluator, the checkpoint retention (lmtrain.checkpoint.manager keeps what is still to be
scored) and the login side's readers (status, history, the exporter, the dashboard) share it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVAL_DIR = "eval"
SCORES = "eval/scores.jsonl"  # one line per scored checkpoint
STATE = "eval/state.json"  # what the evaluator does now (scoring step N, waiting, failed: why)
TRAINING_ENDED = "eval/training-ended"  # the batch script: "<job id> <srun's exit status>" once the trainer's srun ended
EVALUATOR_EXIT = "eval/evaluator-exit"  # the batch script: "<job id> <srun's exit status> <epoch> stopped|exited"
TASKS_DIR = "eval/tasks"  # the shipped tasks, their data paths made absolute (lm-eval reads data_files from the cwd)
EVALUATOR_LOG = "logs/evaluator-%j.log"  # the evaluator's stdout and stderr, by job id (srun --output)


@dataclass(frozen=True)
class EvaluatorPlan:
    """The evaluator's component of the heterogeneous job and what it scores (from the spec's
    ``eval.alongside`` and the profile: launcher.planning.evaluator)."""

    partition: str
    nodes: int
    cpus_per_task: int
    gpus: int
    gres: str | None
    mem: str | None
    tasks: tuple[str, ...]
    task_dirs: tuple[str, ...] = ()
    every_n_steps: int | None = None
    behind: str = "all"  # "all": each in step order, kept until scored; "newest": skip to the newest
    limit: int | None = None
    batch_size: int = 8
    finish_wait_s: int = 600
    log: str = ""  # the evaluator's srun --output (absolute; %j: the job id)
    python: str = ""  # its interpreter command (the profile's eval_python; "": the tasks')

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvaluatorPlan:
        return cls(**{**d, "tasks": tuple(d["tasks"]), "task_dirs": tuple(d.get("task_dirs", ()))})


# --------------------------------------------------------------------------- which checkpoint next
def eligible(step: int, plan: EvaluatorPlan, last: int | None) -> bool:
    """A checkpoint the plan scores: every one, or a multiple of ``every_n_steps``, and the run's last."""
    return plan.every_n_steps is None or step % plan.every_n_steps == 0 or step == last


def next_step(complete: Iterable[int], scored: Iterable[int], plan: EvaluatorPlan, *,
              ended: bool) -> int | None:
    """The step of the complete checkpoint to score next, or None. ``ended``: the training ended,
    so the newest complete checkpoint is the run's last and is scored whatever its step."""
    steps = sorted(set(complete))
    done = set(scored)
    last = steps[-1] if ended and steps else None
    todo = [s for s in steps if s not in done and eligible(s, plan, last)]
    if plan.behind == "newest":
        newest_scored = max(done, default=-1)
        todo = [s for s in todo if s > newest_scored][-1:]
    return todo[0] if todo else None


def still_to_score(complete: Iterable[int], scored: Iterable[int], plan: EvaluatorPlan) -> set[int]:
    """Complete checkpoints retention keeps for the evaluator (``behind: all``): eligible, not scored."""
    if plan.behind != "all":
        return set()
    done = set(scored)
    return {s for s in complete if s not in done and eligible(s, plan, None)}


def kept_for_evaluator(run_dir: str | Path, complete: Iterable[int], plan: EvaluatorPlan) -> set[int]:
    """What the trainer's retention keeps beyond ``keep_last`` (lmtrain.checkpoint.manager): what the
    evaluator has still to score. Not for an evaluator that failed or was killed this attempt (a
    crash, the OOM killer: it would fail again, and keeping for it would fill the disk); for one
    the job stopped, yes: after a preemption or a requeue the next attempt's scores them."""
    state, ended = read_state(run_dir) or {}, read_exit(run_dir)
    if state.get("state") == "failed" or (ended is not None and ended[1] != 0 and not ended[3]):
        return set()
    return still_to_score(complete, scored_steps(read_scores(run_dir), plan.tasks), plan)


# --------------------------------------------------------------------------- the records
@dataclass(frozen=True)
class CheckpointScores:
    """One line of ``eval/scores.jsonl``: every task's metrics of one checkpoint."""

    step: int
    checkpoint: str
    time: float
    job_id: str
    lm_eval: str  # lm-evaluation-harness's version
    seconds: float  # the scoring's wall time (model load and every task)
    scores: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # {task, metric, value, stderr}
    tasks: tuple[str, ...] = ()  # the task names asked (a group's results are its subtasks': named otherwise)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "scores": list(self.scores), "tasks": list(self.tasks)}


def scores_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SCORES


def append_scores(run_dir: str | Path, rec: CheckpointScores) -> None:
    """One write of one line (O_APPEND), flushed to disk: the checkpoint is scored when it is there."""
    path = scores_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(rec.to_json(), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a crash: this one starts anew
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_scores(run_dir: str | Path) -> list[CheckpointScores]:
    """Every scored checkpoint in the order first scored; a torn line (a crash mid-write) is left out.
    A step's further lines (`lmlaunch eval --tasks` adding tasks) add their tasks' metrics to it; a
    task's metric scored twice counts once (its first value)."""
    try:
        text = scores_path(run_dir).read_text()
    except OSError:
        return []
    out: list[CheckpointScores] = []
    seen: dict[int, int] = {}  # step -> its index in out
    for line in text.splitlines():
        try:
            d = json.loads(line)
            rec = CheckpointScores(step=int(d["step"]), checkpoint=str(d["checkpoint"]), time=float(d["time"]),
                                   job_id=str(d["job_id"]), lm_eval=str(d["lm_eval"]), seconds=float(d["seconds"]),
                                   scores=tuple(s for s in d["scores"] if isinstance(s, dict)),
                                   tasks=tuple(str(t) for t in d.get("tasks") or ()))
        except (ValueError, KeyError, TypeError):
            continue
        if rec.step not in seen:
            seen[rec.step] = len(out)
            out.append(rec)
            continue
        first = out[seen[rec.step]]
        have = {(s.get("task"), s.get("metric")) for s in first.scores}
        out[seen[rec.step]] = dataclasses.replace(
            first, scores=first.scores + tuple(s for s in rec.scores if (s.get("task"), s.get("metric")) not in have),
            tasks=(asked := _asked(first)) + tuple(t for t in _asked(rec) if t not in asked))
    return out


def _asked(rec: CheckpointScores) -> tuple[str, ...]:
    """The tasks a line was asked for (one written before they were kept: those its metrics name)."""
    return rec.tasks or tuple(sorted({str(s.get("task")) for s in rec.scores}))


def scored_steps(records: Iterable[CheckpointScores], tasks: Iterable[str]) -> set[int]:
    """The steps whose records hold every one of ``tasks`` as asked (a group is asked by its name;
    its results are its subtasks')."""
    wanted = set(tasks)
    return {r.step for r in records if wanted <= set(_asked(r))}


def flat_scores(records: Iterable[CheckpointScores]) -> list[dict[str, Any]]:
    """One row per checkpoint, task and metric: step, task, metric, value, stderr, lm_eval."""
    return [{"step": r.step, "task": s.get("task"), "metric": s.get("metric"), "value": s.get("value"),
             "stderr": s.get("stderr"), "lm_eval": r.lm_eval} for r in records for s in r.scores]


def latest_scores(records: list[CheckpointScores]) -> dict[str, Any] | None:
    """The newest scored checkpoint's step and its metrics as ``task/metric -> value``; None: none yet."""
    if not records:
        return None
    newest = max(records, key=lambda r: r.step)
    return {"step": newest.step, "scores": {f"{s.get('task')}/{s.get('metric')}": s.get("value")
                                            for s in newest.scores}}


def read_exit(run_dir: str | Path) -> tuple[str, int, float, bool] | None:
    """The evaluator's srun's end this attempt (job id, exit status, time, whether the job stopped it:
    a preemption, a requeue, a cancel, finish_wait_s over); None while it runs or never ran."""
    try:
        words = (Path(run_dir) / EVALUATOR_EXIT).read_text().split()
        return words[0], int(words[1]), float(words[2]), words[3:4] == ["stopped"]
    except (OSError, ValueError, IndexError):
        return None


def read_state(run_dir: str | Path) -> dict[str, Any] | None:
    """The evaluator's own word on what it does (``eval/state.json``): state, step, detail, time, job_id."""
    try:
        d = json.loads((Path(run_dir) / STATE).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None
