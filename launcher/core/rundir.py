"""The run directory's contract: its files, their records, one writer and one reader for each.

Both sides use this module: the runtime (lmtrain) writes the ledger, the heartbeat and the
markers; the CLI (status, history, logs, report, cancel) and the test fixtures read them.
:class:`RunLayout` spells every path in it (docs/run-directory.md lists the files): the ledger
``attempts.jsonl`` (one :class:`AttemptStart` and one :class:`AttemptEnd` line per attempt,
:class:`LedgerNote` lines), rank 0's ``metrics/heartbeat.jsonl`` (read by its tail only), the
``DONE`` and ``CANCELLED`` markers, ``plan.json``, and the attempts' logs. The ledger and the
heartbeat are JSON lines (:mod:`launcher.core.jsonlines`); a checkpoint directory the plan put
outside the run directory is found from its plan.json (:func:`checkpoint_dir_of`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher.core.atomic import write_json
from launcher.core.jsonlines import append_jsonl, read_jsonl

LEDGER = "attempts.jsonl"
HEARTBEAT = "metrics/heartbeat.jsonl"
PLAN = "plan.json"
DONE = "DONE"
CANCELLED = "CANCELLED"
CHECKPOINTS = "checkpoints"  # the default checkpoint directory; the plan may name another
LOGS = "logs"
CODE_DIR = "code"  # the code snapshot every attempt imports (launcher.snapshot, PYTHONPATH in the plan)
ENVIRONMENT = "environment.json"  # logs/attempt-<N>/: what the attempt ran on (lmtrain.environment_record)
HANG_MARKER = "hang-rank-{rank}.json"  # logs/attempt-<N>/: a rank's hang report (lmtrain.watchdog)
LAST_WORDS = "exit-rank-{rank}.json"  # logs/attempt-<N>/: how a rank ended badly (lmtrain.preemption.first_death)
TASK_RECORD = "tasks/{job_id}-{restart_count}/rank-{rank}.json"  # logs/: where a task runs, its pid (core.task_records; lmlaunch stacks)


# --------------------------------------------------------------------------- heartbeat
HEARTBEAT_EVENTS = frozenset({"start", "step", "val", "checkpoint", "checkpoint_failed", "end"})


class Heartbeat:
    """``metrics/heartbeat.jsonl``: rank 0's lines (``enabled`` only there), each with the time,
    the event, its fields, and who wrote it (attempt, job id, world size). docs/run-directory.md
    lists each event's fields; the monitor reads the file's tail only."""

    def __init__(self, path: str | Path, *, attempt: int, job_id: str | None, world_size: int,
                 enabled: bool = True) -> None:
        self.path = Path(path)
        self.who = {"attempt": attempt, "job_id": job_id, "world_size": world_size}
        self.enabled = enabled

    def emit(self, event: str, **fields: Any) -> None:
        if event not in HEARTBEAT_EVENTS:
            raise ValueError(f"heartbeat event {event!r} is not one of {sorted(HEARTBEAT_EVENTS)}")
        if self.enabled:
            append_jsonl(self.path, {"time": time.time(), "event": event, **fields, **self.who})


# --------------------------------------------------------------------------- ledger records
@dataclass(frozen=True)
class AttemptStart:
    """Rank 0, when an attempt begins (after the start gate, before training)."""

    attempt: int
    job_id: str | None
    restart_count: int
    time: float
    start_step: int
    nodes: list[str]
    world_size: int

    def to_json(self) -> dict[str, Any]:
        return {"event": "start", **asdict(self)}


@dataclass(frozen=True)
class AttemptEnd:
    """Rank 0 (or the hang watchdog), once per attempt: why it ended and what happens next."""

    attempt: int
    job_id: str | None
    time: float
    end_step: int
    reason: str
    detail: str | None = None
    requeued: bool = False
    skipped: bool = False  # ended by the start gate, without training
    extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. the universal conversion's facts

    def to_json(self) -> dict[str, Any]:
        d = {"event": "end", **asdict(self)}
        d.pop("extra")
        if not self.skipped:
            d.pop("skipped")
        return {**d, **self.extra}


STARTUP_PHASES = ("entry", "imports", "gate", "rendezvous", "data", "model", "restore", "first_step")


@dataclass(frozen=True)
class AttemptStartup:
    """Rank 0, once per attempt (at its first step, or at its end when it never got there): the
    seconds from the task process's start to the end of each startup phase (lmtrain.startup)."""

    attempt: int
    job_id: str | None
    process_start: float  # epoch seconds
    phases: Mapping[str, float]  # phase -> seconds after process_start, in STARTUP_PHASES order
    checkpoint_bytes: int | None = None  # what the attempt resumed from (None: started fresh)

    def to_json(self) -> dict[str, Any]:
        return {"event": "startup", **asdict(self), "phases": dict(self.phases)}


@dataclass(frozen=True)
class LedgerNote:
    """Any other ledger line: ``cancel_requested`` (the CLI), ``requeue_failed``/``cancel_failed``."""

    event: str
    time: float
    fields: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"event": self.event, "time": self.time, **self.fields}


@dataclass
class LedgerAttempt:
    """One attempt as the ledger tells it (the runtime's view: what the start gate and the
    end decision need). The monitor's fuller view is ``launcher.history_rows.HistoryRow``."""

    attempt: int
    job_id: str | None
    start_step: int
    end_step: int | None = None
    reason: str | None = None  # None: no end line (yet)
    requeued: bool = False
    skipped: bool = False


_END_LOCK = threading.Lock()


class Ledger:
    """``attempts.jsonl``: the one writer and reader of the attempt records."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write(self, record: AttemptStart | AttemptEnd | AttemptStartup | LedgerNote) -> None:
        append_jsonl(self.path, record.to_json())

    def write_end_once(self, end: AttemptEnd) -> bool:
        """Write ``end`` unless the attempt already has an end line (the hang watchdog's thread
        and the entry's ``finally`` may both try); True when written."""
        with _END_LOCK:
            if any(e.get("event") == "end" and e.get("attempt") == end.attempt for e in self.entries()):
                return False
            self.write(end)
            return True

    def entries(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def attempts(self) -> list[LedgerAttempt]:
        return attempts_of(self.entries())

    def next_attempt(self) -> int:
        return next_attempt_of(self.entries())


def next_attempt_of(entries: Sequence[Mapping[str, Any]]) -> int:
    """1 + the number of attempts already started."""
    return 1 + sum(1 for e in entries if e.get("event") == "start")


def attempts_of(entries: Sequence[Mapping[str, Any]]) -> list[LedgerAttempt]:
    rows: dict[int, LedgerAttempt] = {}
    for e in entries:
        n = e.get("attempt")
        if not isinstance(n, int):
            continue
        if e.get("event") == "start":
            rows[n] = LedgerAttempt(attempt=n, job_id=e.get("job_id"), start_step=int(e.get("start_step") or 0))
        elif e.get("event") == "end" and n in rows:
            row = rows[n]
            row.end_step = e.get("end_step")
            row.reason = e.get("reason")
            row.requeued = bool(e.get("requeued"))
            row.skipped = bool(e.get("skipped"))
    return [rows[n] for n in sorted(rows)]


# --------------------------------------------------------------------------- markers and paths
def read_done_step(run_dir: str | Path) -> tuple[bool, int | None]:
    """(DONE exists, the step it names)."""
    try:
        text = (Path(run_dir) / DONE).read_text().strip()
    except FileNotFoundError:
        return False, None
    except OSError:
        return True, None
    return True, int(text) if text.isdigit() else None


def is_cancelled(run_dir: str | Path) -> bool:
    return (Path(run_dir) / CANCELLED).exists()


def attempt_logs_dir(run_dir: str | Path, attempt: int) -> Path:
    return RunLayout.of(run_dir).attempt_logs(attempt)


@dataclass(frozen=True)
class RunLayout:
    """Where each file of a run directory lives (docs/run-directory.md): the one place that spells
    those paths, as submitit's ``JobPaths`` is for its folder. ``logs`` and ``checkpoints`` are
    where the plan put them (:meth:`of_plan`), else the defaults."""

    run_dir: Path
    logs: Path
    checkpoint_dir: Path | None = None  # None: the plan's, read from plan.json when asked

    @classmethod
    def of(cls, run_dir: str | Path) -> RunLayout:
        return cls(Path(run_dir), Path(run_dir) / LOGS)

    @classmethod
    def of_plan(cls, plan: Any) -> RunLayout:
        """From a :class:`launcher.core.plan.LaunchPlan` (its ``paths``)."""
        p = plan.paths
        return cls(Path(p.run_dir), Path(p.logs_dir), Path(p.checkpoint_dir))

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or checkpoint_dir_of(self.run_dir)

    @property
    def done(self) -> Path:
        return self.run_dir / DONE

    @property
    def cancelled(self) -> Path:
        return self.run_dir / CANCELLED

    @property
    def rendezvous(self) -> Path:
        """Rank 0's answers for an attempt's ranks: rendezvous, start gate, verified checkpoint."""
        return self.run_dir / "rendezvous"

    def rendezvous_file(self, key: str) -> Path:
        return self.rendezvous / f"{key}.json"

    def gate_file(self, key: str) -> Path:
        return self.rendezvous / f"{key}.gate.json"

    def verify_file(self, key: str, attempt: int) -> Path:
        return self.rendezvous / f"{key}-attempt-{attempt}.verify"

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs / f"attempt-{attempt}"

    def attempts_logged(self) -> list[tuple[int, Path]]:
        """Every attempt's log directory, by attempt number."""
        out = []
        try:
            for p in self.logs.iterdir():
                m = re.fullmatch(r"attempt-(\d+)", p.name)
                if m and p.is_dir():
                    out.append((int(m.group(1)), p))
        except OSError:
            return []
        return sorted(out)

    @property
    def local_logs(self) -> Path:
        """``run --local``: each rank's own stdout and stderr (lmtrain.local)."""
        return self.logs / "local"

    def rank_log(self, attempt: int, rank: int | str) -> Path:
        return self.attempt_logs(attempt) / f"rank-{rank}.log"

    def environment(self, attempt: int) -> Path:
        return self.attempt_logs(attempt) / ENVIRONMENT

    def last_words(self, attempt: int, rank: int | str) -> Path:
        return self.attempt_logs(attempt) / LAST_WORDS.format(rank=rank)

    def stacks(self, attempt: int, rank: int | str) -> Path:
        """A hung rank's Python stacks (lmtrain.watchdog, ``lmlaunch stacks``)."""
        return self.attempt_logs(attempt) / f"stacks-rank-{rank}.txt"

    def hang_marker(self, attempt: int, rank: int | str) -> Path:
        return self.attempt_logs(attempt) / HANG_MARKER.format(rank=rank)

    def task_record(self, job_id: str, restart_count: int, rank: int) -> Path:
        return self.logs / TASK_RECORD.format(job_id=job_id, restart_count=restart_count, rank=rank)


def environment_records(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every attempt's environment record, by attempt number (unreadable ones left out)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted((Path(run_dir) / LOGS).glob(f"attempt-*/{ENVIRONMENT}")):
        n = path.parent.name.removeprefix("attempt-")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if n.isdigit() and isinstance(d, dict):
            out[int(n)] = d
    return out


# Words of errors that only say another rank went away (a symptom, not the first death).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "GLHF", "NCCL communicator was aborted",
             "Broken pipe", "Socket Timeout", "recvBytes", "failed to recv", "Connection refused")


def is_peer_lost(text: str) -> bool:
    return any(p in text for p in PEER_LOST)


@dataclass(frozen=True)
class LastWords:
    """How one rank of an attempt ended badly, in its own words (``source`` "rank": the exception
    it died of) or in its launcher's ("launcher": the signal or exit code the local launcher saw)."""

    rank: int
    node: str
    pid: int | None
    time: float
    how: str  # "exception" | "signal" | "exit"
    detail: str  # the exception's last line, "SIGKILL", "exit code 3"
    peer_lost: bool = False  # the error only says that another rank went away: a symptom
    source: str = "rank"

    def write(self, run_dir: str | Path, attempt: int) -> None:
        path = RunLayout.of(run_dir).last_words(attempt, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, asdict(self))

    @classmethod
    def read_all(cls, run_dir: str | Path, attempt: int) -> list[LastWords]:
        out = []
        names = set(cls.__dataclass_fields__)
        for path in sorted(RunLayout.of(run_dir).attempt_logs(attempt).glob(LAST_WORDS.format(rank="*"))):
            try:
                d = json.loads(path.read_text())
                out.append(cls(**{k: v for k, v in d.items() if k in names}))
            except (OSError, ValueError, TypeError):
                continue
        return out


def checkpoint_dir_of(run_dir: str | Path) -> Path:
    """Where the run's checkpoints are: the plan's ``paths.checkpoint_dir``, else the default. A
    checkpoint directory inside the run directory is taken relative to where the run directory is
    now (a copied or moved run directory reads its own checkpoints, not the original's)."""
    run_dir = Path(run_dir)
    try:
        paths = json.loads((run_dir / PLAN).read_text())["paths"]
        d = paths["checkpoint_dir"]
        if isinstance(d, str) and d:
            planned_run_dir = paths.get("run_dir")
            if isinstance(planned_run_dir, str) and planned_run_dir:
                try:
                    return run_dir / Path(d).relative_to(planned_run_dir)
                except ValueError:
                    pass  # a checkpoint.dir of its own, outside the run directory
            return Path(d)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return run_dir / CHECKPOINTS


def startup_breakdown(record: Mapping[str, Any], alloc_start: float | None = None) -> dict[str, float]:
    """Pure: a ledger ``startup`` record -> seconds spent in each phase it reached, in order;
    with the allocation's start (sacct, whole seconds) first the ``launch`` phase up to the
    process start (the batch script, srun, the interpreter being exec'd)."""
    out: dict[str, float] = {}
    phases = record.get("phases") or {}
    start = record.get("process_start")
    if alloc_start is not None and isinstance(start, (int, float)):
        out["launch"] = round(max(0.0, float(start) - alloc_start), 3)
    previous = 0.0
    for name in STARTUP_PHASES:
        end = phases.get(name)
        if isinstance(end, (int, float)):
            out[name] = round(max(0.0, float(end) - previous), 3)
            previous = float(end)
    return out
