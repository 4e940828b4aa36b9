"""Reading a run directory for the monitor: the files a status row, a history and the logs
are built from (formats and their one writer: ``lmcore.run.rundir``; docs/run-directory.md).
Cheap by design: the heartbeat by its last few KB only, the small ledger whole."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcore.jsonlines import read_jsonl, read_tail
from lmcore.run.checkpoint_index import COMPLETE_NAME, newest_complete
from lmcore.run.eval_alongside import EVAL_DIR
from lmcore.run.rank_logs import node_log_of, srun_node_file_of, take_rank, take_srun_task
from lmcore.run.rundir import SUBMITIT_TASK_LOG, RunLayout, checkpoint_dir_of


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    mtime: float


def newest_checkpoint(checkpoint_dir: Path) -> Checkpoint | None:
    """The run's newest COMPLETE checkpoint (the one the next attempt resumes from), dated by
    its COMPLETE marker; by its markers, no file of it stat'ed (a checkpoint of 16,384 ranks' shards
    would cost status 16,384 stats; rank 0 checks every file before it resumes)."""
    ckpt = newest_complete(checkpoint_dir, files=False)
    if ckpt is None:
        return None
    try:
        mtime = (ckpt.path / COMPLETE_NAME).stat().st_mtime
    except OSError:
        return None
    return Checkpoint(ckpt.step, str(ckpt.path), mtime)


@dataclass
class RunFiles:
    """What one run directory says, read cheaply."""

    heartbeat: list[dict[str, Any]] = field(default_factory=list)  # the tail only
    ledger: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    done: bool = False
    cancelled: bool = False
    plan_time: str | None = None  # the planned time limit, for jobs SLURM has forgotten
    exists: bool = True
    evaluation: Any = None  # the evaluator alongside (launcher.monitor.eval_rows.Evaluation); None: none


def read_run_files(run_dir: Path, *, with_plan_time: bool = False) -> RunFiles:
    if not run_dir.is_dir():
        return RunFiles(exists=False)
    layout = RunLayout.of(run_dir)
    rf = RunFiles(
        heartbeat=read_tail(layout.heartbeat),
        ledger=read_jsonl(layout.ledger),
        checkpoint=newest_checkpoint(checkpoint_dir_of(run_dir)),
        done=layout.done.exists(),
        cancelled=layout.cancelled.exists(),
    )
    if (run_dir / EVAL_DIR).is_dir():
        from launcher.monitor.eval_rows import read_evaluation

        rf.evaluation = read_evaluation(run_dir)
    if with_plan_time:
        rf.plan_time = read_plan_time(run_dir)
    return rf


def read_rank_times(run_dir: Path) -> dict[str, Any] | None:
    """Rank 0's summary of every rank's newest step timing and the slow ranks
    (``metrics/rank-times.json``, lmtrain.health.straggler_watch), or None when there is none or it
    cannot be read (the exporter then shows no per-rank series for the run)."""
    try:
        data = json.loads(RunLayout.of(run_dir).rank_times.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), dict):
        return None
    data["ranks"] = {k: v for k, v in data["ranks"].items() if str(k).isdigit() and isinstance(v, dict)}
    return data


def read_world_size(run_dir: Path) -> int | None:
    """The ranks the run was planned with (plan.json), or None when it cannot be read."""
    try:
        size = json.loads(RunLayout.of(run_dir).plan.read_text())["topology"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def read_plan_time(run_dir: Path) -> str | None:
    try:
        return str(json.loads(RunLayout.of(run_dir).plan.read_text())["slurm"]["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- logs (pure listing)


@dataclass(frozen=True)
class LogSource:
    """One file to show: an attempt's node log (``rank``: only that rank's lines, unmarked), a rank's
    own log of a run of before, or srun's output of a job's tasks: a node's file (``rank`` and
    ``srun_labels``: that task's lines, without srun's label) or a task's own of a run of before."""

    attempt: int | None
    job_id: str | None
    path: Path
    label: str
    rank: int | None = None
    srun_labels: bool = False

    def take(self, lines: Iterable[str]) -> list[str]:
        """Of whole lines read from the file, those to show (all of them in a file of one rank's)."""
        if self.rank is None:
            return list(lines)
        return take_srun_task(lines, self.rank) if self.srun_labels else take_rank(lines, self.rank)


def attempt_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    return RunLayout.of(run_dir).attempts_logged()


def evaluator_sources(run_dir: Path, job_ids: Sequence[str]) -> list[LogSource]:
    """The evaluator's logs (``logs/evaluator-<job>.log``, srun's output): of the run's jobs
    (eval.alongside) in their order, then of `lmlaunch eval`'s jobs, oldest first."""
    logs = RunLayout.of(run_dir).logs
    found = {p.name.removeprefix("evaluator-").removesuffix(".log"): p for p in logs.glob("evaluator-*.log")}
    order = [j for j in job_ids if j in found] + sorted((j for j in found if j not in job_ids),
                                                        key=lambda j: found[j].stat().st_mtime)
    return [LogSource(None, j, found[j], f"job {j}, the evaluator" + ("" if j in job_ids else " (lmlaunch eval)"))
            for j in order]


def log_sources(run_dir: Path, job_ids: Sequence[str], *, rank: int = 0, attempt: int | None = None,
                evaluator: bool = False) -> list[LogSource]:
    """The files of ``rank`` for every attempt in order (or only ``attempt``); srun's output of each
    job's task ``rank`` when no attempt has a log of its own (the node's ``%j_node-%n_log.out/.err``,
    or the task's ``%j_%t_log.out/.err`` of a run of before); the evaluator's logs too (``evaluator``)."""
    more = evaluator_sources(run_dir, job_ids) if evaluator and attempt is None else []
    return _rank_sources(run_dir, job_ids, rank=rank, attempt=attempt) + more


def _rank_sources(run_dir: Path, job_ids: Sequence[str], *, rank: int, attempt: int | None) -> list[LogSource]:
    out = []
    for n, d in attempt_dirs(run_dir):
        if attempt is not None and n != attempt:
            continue
        node = node_log_of(d, rank)  # the rank's lines in its node's log
        if node is not None:
            out.append(LogSource(n, None, node, f"attempt {n}, rank {rank}", rank=rank))
            continue
        p = RunLayout.of(run_dir).rank_log(n, rank)  # a run of before: a file per rank
        if p.exists():
            out.append(LogSource(n, None, p, f"attempt {n}, rank {rank}"))
    if out or (attempt is not None and attempt_dirs(run_dir)):
        return out
    layout = RunLayout.of(run_dir)
    for jid in job_ids:
        nodes = {ext: layout.submitit_node_logs(jid, ext) for ext in ("out", "err")}
        if not any(nodes.values()):  # a run of before: a file per task (task 0's held the batch script's too)
            for ext in ("out", "err"):
                p = layout.submitit / SUBMITIT_TASK_LOG.format(job=jid, rank=rank, ext=ext)
                if p.exists():
                    out.append(LogSource(None, jid, p, f"job {jid}, task {rank}, submitit {ext}"))
            continue
        for ext in ("out", "err"):  # the task's lines of its node's file, then the batch script's and srun's own
            node = srun_node_file_of(nodes[ext], rank)
            if node is not None:
                out.append(LogSource(None, jid, node, f"job {jid}, task {rank}, srun {ext}", rank=rank, srun_labels=True))
        for ext in ("out", "err"):
            p = layout.submitit / SUBMITIT_TASK_LOG.format(job=jid, rank=0, ext=ext)
            if p.exists():
                out.append(LogSource(None, jid, p, f"job {jid}, the batch script and srun, {ext}"))
    return out


_ERROR_LINE = re.compile(
    r"(Traceback \(most recent call last\)|\b[A-Z][A-Za-z]*(Error|Exception)\b|\bERROR\b|\bCRITICAL\b|\bFATAL\b|"
    r"srun: error|slurmstepd: error|\bKilled\b|OOM|out of memory|DUE TO (TIME LIMIT|PREEMPTION)|CANCELLED AT|"
    r"^(Error|error|FATAL|ERROR):|^pyxis: .*(error|failed))"  # a container runtime's own (podman, apptainer, pyxis)
)


def error_lines(lines: Iterable[str]) -> list[str]:
    """Tracebacks (whole) and error lines; everything else dropped."""
    out: list[str] = []
    in_tb = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
            out.append(line)
            continue
        if in_tb:
            out.append(line)
            if line and not line[0].isspace():
                in_tb = False  # the exception line closes the traceback
            continue
        if _ERROR_LINE.search(line):
            out.append(line)
    return out


def attempt_marker(n: int | None, ledger: Sequence[Mapping[str, Any]], label: str) -> str:
    """The line between attempts: who ran it, from which step, and how the previous one ended."""
    if n is None:
        return f"──── {label} ────"
    start = next((e for e in ledger if e.get("event") == "start" and e.get("attempt") == n), None)
    end = next((e for e in ledger if e.get("event") == "end" and e.get("attempt") == n), None)
    bits = [f"attempt {n}"]
    if start:
        several = len({e.get("profile") for e in ledger if e.get("event") == "start"}) > 1  # its clusters' profiles
        bits.append(f"job {start.get('job_id')}" + (f" of {start['profile']}" if several and start.get("profile") else ""))
        if start.get("nodes"):
            bits.append("on " + ",".join(start["nodes"]))
        if start.get("start_step") is not None:
            bits.append(f"from step {start['start_step']}")
        if start.get("time"):
            bits.append("started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(start["time"]))))
    if end:
        bits.append(f"ended {end.get('reason')} at step {end.get('end_step')}")
    return f"──── {' · '.join(bits)} ────"
