"""The run directory's contract: its files, their records, one writer and one reader for each.

Both sides use this module: the runtime (lmtrain) writes the ledger, the heartbeat and the
markers; the CLI (status, history, logs, report, cancel) and the test fixtures read them.
:class:`RunLayout` spells every path in it (docs/run-directory.md lists the files): the ledger
``attempts.jsonl`` (one :class:`AttemptStart` and one :class:`AttemptEnd` line per attempt,
:class:`LedgerNote` lines), rank 0's ``metrics/heartbeat.jsonl`` (read by its tail only), the
``DONE`` and ``CANCELLED`` markers, ``plan.json``, and the attempts' logs. The ledger and the
heartbeat are JSON lines (:mod:`lmcore.jsonlines`); a checkpoint directory the plan put
outside the run directory is found from its plan.json (:func:`checkpoint_dir_of`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmcore.jsonlines import append_jsonl, read_jsonl
from lmcore.run.run_layout import (
    CANCELLED as CANCELLED,
    CHECKPOINTS as CHECKPOINTS,
    CODE_DIR as CODE_DIR,
    CODE_ZIP as CODE_ZIP,
    CSV as CSV,
    DEEPSPEED_JSON as DEEPSPEED_JSON,
    DONE as DONE,
    ENVIRONMENT as ENVIRONMENT,
    HANG_MARKER as HANG_MARKER,
    HEARTBEAT as HEARTBEAT,
    LAST_WORDS as LAST_WORDS,
    LAST_WORDS_OF_A_RANK as LAST_WORDS_OF_A_RANK,
    LEDGER as LEDGER,
    LOGS as LOGS,
    METRICS as METRICS,
    PLAN as PLAN,
    PREPARATION as PREPARATION,
    PREPARATION_JOBS as PREPARATION_JOBS,
    RANK_TIMES as RANK_TIMES,
    REPORT as REPORT,
    RESTART_IN_PLACE as RESTART_IN_PLACE,
    SPEC_YAML as SPEC_YAML,
    SUBMITIT as SUBMITIT,
    SUBMITIT_NODE_LOG as SUBMITIT_NODE_LOG,
    SUBMITIT_TASK_LOG as SUBMITIT_TASK_LOG,
    TASK_RECORD as TASK_RECORD,
    TASK_RECORD_OF_A_RANK as TASK_RECORD_OF_A_RANK,
    TENSORBOARD as TENSORBOARD,
    WANDB_ID as WANDB_ID,
    RunLayout as RunLayout,
    attempt_logs_dir as attempt_logs_dir,
    checkpoint_dir_of as checkpoint_dir_of,
    environment_records as environment_records,
    is_cancelled as is_cancelled,
    read_done_step as read_done_step,
    unzipped as unzipped,
)

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
    spares: list[str] | None = None  # a job with spare nodes: those it holds idle now (resources.spare_nodes)
    groups: dict[str, str | None] | None = None  # node -> its leaf switch or block (a plan with a placement)
    profile: str | None = None  # the cluster profile it was planned on (a run over several clusters: which one)
    gpus: int | None = None  # the GPUs its allocation holds (GPUs per node x its nodes, spares included); None: a CPU job

    def to_json(self) -> dict[str, Any]:
        line = {"event": "start", **asdict(self)}
        for key in ("spares", "groups", "profile", "gpus"):
            if line[key] is None:
                del line[key]
        return line


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
    seconds from the task process's start to the end of each startup phase (lmtrain.observe.startup)."""

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
    end decision need). The monitor's fuller view is ``launcher.monitor.history_rows.HistoryRow``."""

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


# Words of errors that only say another rank went away (a symptom, not the first death).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "GLHF", "NCCL communicator was aborted",
             "Broken pipe", "Socket Timeout", "recvBytes", "failed to recv", "Connection refused")


def left_out_of(entries: Sequence[Mapping[str, Any]], job_id: str | None) -> list[str]:
    """The nodes ``job_id``'s restarts in place leave out so far: the newest end line of that job
    that says (``left_out``: spare nodes, launcher.submit.script)."""
    said = [e["left_out"] for e in entries if e.get("event") == "end" and str(e.get("job_id")) == str(job_id)
            and isinstance(e.get("left_out"), list)]
    return [str(n) for n in said[-1]] if said else []


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
        """One line appended to the node's file in one write (lmcore.jsonlines): the node's dying
        ranks never interleave, and a node's file, not a rank's, is created."""
        append_jsonl(RunLayout.of(run_dir).last_words(attempt, self.node), asdict(self))

    @classmethod
    def say_for(cls, run_dir: str | Path, attempt: int, *, rank: int, node: str, pid: int | None, code: int,
                source: str) -> None:
        """A process's launcher on its behalf: it ended with ``code`` (negative: the signal, as
        subprocess gives it) without last words of its own; nothing when it has them."""
        if any(w.rank == rank for w in cls.read_all(run_dir, attempt)):
            return
        if code < 0:
            import signal

            try:
                how, detail = "signal", signal.Signals(-code).name
            except ValueError:
                how, detail = "signal", f"signal {-code}"
        else:
            how, detail = "exit", f"exited with code {code} without a Python error"
        cls(rank=rank, node=node, pid=pid, time=time.time(), how=how, detail=detail, source=source).write(
            run_dir, attempt)

    @classmethod
    def read_all(cls, run_dir: str | Path, attempt: int) -> list[LastWords]:
        """Every rank's last words of an attempt, the nodes' files and a run of before's files per
        rank; a line or file that does not read is left out (a rank killed in its write)."""
        out = []
        names = set(cls.__dataclass_fields__)
        logs = RunLayout.of(run_dir).attempt_logs(attempt)
        found: list[dict[str, Any]] = []
        for path in sorted(logs.glob(LAST_WORDS_OF_A_RANK.format(rank="*"))):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        for path in sorted(logs.glob(LAST_WORDS.format(node="*"))):
            found += read_jsonl(path)
        for d in found:
            try:
                out.append(cls(**{k: v for k, v in d.items() if k in names}))
            except TypeError:
                continue
        return sorted(out, key=lambda w: (w.time, w.rank))


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
