"""What `lmlaunch status`, `history`, `logs` and `report` know about runs (no rendering here).

The only I/O is at the edges: :func:`query_slurm` makes ONE ``squeue`` call for the current job
of every run and at most ONE ``sacct`` call (only for the jobs the controller has forgotten);
run directories are read directly (the heartbeat by its last few KB only, the small attempts
ledger whole). Everything else is pure functions from those readings to row models, so the
renderers and tests work on synthetic run directories. Formats: docs/run-directory.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import hostlist

HEARTBEAT_TAIL_BYTES = 16384  # ~60 heartbeat lines: enough for the last step, checkpoint and rate
UNREACHABLE = "unknown (SLURM unreachable)"
CACHE_FILE = "cache/final-jobs.json"  # under $LMLAUNCH_HOME: sacct rows of jobs that can no longer change
SLURM_TIMEOUT_S = 10.0  # status waits this long for a busy controller, then shows the run dirs alone

# --------------------------------------------------------------------------- reading run directories


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """JSON lines; a line that does not parse (a write in progress, a cut tail) is skipped."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_tail(path: Path, max_bytes: int = HEARTBEAT_TAIL_BYTES) -> list[dict[str, Any]]:
    """The last whole JSON lines of ``path`` within its last ``max_bytes`` (never the whole file)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    if start > 0:
        nl = data.find(b"\n")
        data = data[nl + 1 :] if nl >= 0 else b""  # the first line is cut: drop it
    return parse_jsonl(data.decode("utf-8", errors="replace"))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return parse_jsonl(path.read_text(errors="replace"))
    except OSError:
        return []


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    mtime: float


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint (``checkpoints/latest`` names it; its COMPLETE marker dates it)."""
    ckdir = run_dir / "checkpoints"
    try:
        name = (ckdir / "latest").read_text().strip()
    except OSError:
        return None
    m = re.search(r"step-(\d+)", name)
    if not m:
        return None
    path = ckdir / Path(name).name
    try:
        mtime = (path / "COMPLETE").stat().st_mtime
    except OSError:
        try:
            mtime = (ckdir / "latest").stat().st_mtime
        except OSError:
            return None
    return Checkpoint(int(m.group(1)), str(path), mtime)


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


def read_run_files(run_dir: Path, *, with_plan_time: bool = False) -> RunFiles:
    if not run_dir.is_dir():
        return RunFiles(exists=False)
    rf = RunFiles(
        heartbeat=read_tail(run_dir / "metrics" / "heartbeat.jsonl"),
        ledger=read_jsonl(run_dir / "attempts.jsonl"),
        checkpoint=latest_checkpoint(run_dir),
        done=(run_dir / "DONE").exists(),
        cancelled=(run_dir / "CANCELLED").exists(),
    )
    if with_plan_time:
        rf.plan_time = read_plan_time(run_dir)
    return rf


def read_plan_time(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / "plan.json").read_text())["slurm"]["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- SLURM (one call each)


@dataclass(frozen=True)
class SlurmJob:
    """One job as status shows it, whichever of squeue/sacct knew it."""

    job_id: str
    state: str  # SLURM's word: PENDING, RUNNING, COMPLETED, PREEMPTED, CANCELLED ...
    reason: str
    attempts: int  # SLURM attempts of this job id so far (requeues + 1)
    time_limit: str = ""
    num_nodes: int = 0
    elapsed: str = ""
    nodelist: str = ""
    source: str = "squeue"


@dataclass
class SlurmView:
    jobs: dict[str, SlurmJob]
    reachable: bool = True
    message: str = ""
    calls: list[str] = field(default_factory=list)  # which SLURM commands ran (pinned by tests)


def _cache_path(environ: Mapping[str, str] | None) -> Path:
    from launcher.runs import lmlaunch_home

    return lmlaunch_home(environ) / CACHE_FILE


def _load_cache(environ: Mapping[str, str] | None) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_cache_path(environ).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict[str, dict[str, Any]], environ: Mapping[str, str] | None) -> None:
    from launcher.atomic import write_private

    path = _cache_path(environ)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, json.dumps(cache, sort_keys=True))
    except OSError:
        pass  # a cache that cannot be written only costs the next status one sacct call


def query_slurm(job_ids: Iterable[str], *, environ: Mapping[str, str] | None = None, cache: bool = True) -> SlurmView:
    """ONE squeue call for all ``job_ids``; ONE sacct call for those squeue no longer knows.

    A job the controller has forgotten is finished for good, so its sacct answer is cached
    (``$LMLAUNCH_HOME/cache/final-jobs.json``) and later calls skip sacct for it.
    Never raises for an unreachable SLURM: the view says so instead.
    """
    from launcher import slurm
    from launcher.errors import SlurmUnavailable, UserError

    ids = sorted({str(j) for j in job_ids if j}, key=_job_sort_key)
    view = SlurmView(jobs={})
    if not ids:
        return view
    try:
        view.calls.append("squeue")
        for q in slurm.squeue_status(ids, timeout=SLURM_TIMEOUT_S):
            view.jobs[q.job_id] = SlurmJob(q.job_id, q.state, q.reason, q.restarts + 1, q.time_limit,
                                           q.num_nodes, q.elapsed, q.nodelist, "squeue")
    except (SlurmUnavailable, UserError) as exc:
        view.reachable = False
        view.message = exc.message
        return view
    cached = _load_cache(environ) if cache else {}
    missing = [j for j in ids if j not in view.jobs and j not in cached]
    for j in ids:
        if j not in view.jobs and j in cached:
            view.jobs[j] = SlurmJob(**{**cached[j], "source": "cache"})
    if missing:
        try:
            view.calls.append("sacct")
            rows = slurm.sacct(missing, duplicates=True, timeout=SLURM_TIMEOUT_S)
        except (SlurmUnavailable, UserError) as exc:
            view.message = f"accounting: {exc.message}"
            rows = []
        by_job: dict[str, list[Any]] = {}
        for r in rows:
            by_job.setdefault(r.job_id, []).append(r)
        for jid, attempts in by_job.items():
            last = attempts[-1]
            job = SlurmJob(jid, last.state.split()[0], "", len(attempts), "", _count_nodes(last.nodes),
                           _sacct_elapsed(last.elapsed), last.nodes, "sacct")
            view.jobs[jid] = job
            if cache and not slurm.is_active(last.state):
                cached[jid] = {k: v for k, v in asdict(job).items() if k != "source"}
        if cache and by_job:
            _save_cache(cached, environ)
    return view


def _job_sort_key(jid: str) -> tuple[int, str]:
    head = jid.split("_")[0]
    return (int(head) if head.isdigit() else 0, jid)


def _count_nodes(nodelist: str) -> int:
    """'n[1-3,7],gpu5' -> 5 (SLURM hostlist notation)."""
    if not nodelist or nodelist in ("None assigned", "(null)"):
        return 0
    try:
        return len(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist:
        return nodelist.count(",") + 1  # not SLURM's notation after all: one name per item


def _sacct_elapsed(text: str) -> str:
    """sacct's 00:00:33 -> squeue's 0:33 (one format in the table)."""
    days, _, hms = text.rpartition("-")
    parts = hms.split(":")
    if not all(p.isdigit() for p in parts):
        return text
    secs = 0
    for p in parts:
        secs = secs * 60 + int(p)
    secs += int(days) * 86400 if days.isdigit() else 0
    return format_duration(secs, slurm_style=True)


def parse_slurm_duration(text: str) -> float | None:
    """'1-02:03:04', '2:00:00', '20:00', '0:33', 'UNLIMITED' -> seconds (None when not a duration)."""
    if not text or not text[0].isdigit():
        return None
    days, _, hms = text.rpartition("-") if "-" in text else ("", "", text)
    parts = hms.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    secs = 0
    for p in parts:
        secs = secs * 60 + int(p)
    if len(parts) == 1:
        secs *= 60  # a bare number in a time limit is minutes
    return float(secs + (int(days) * 86400 if days.isdigit() else 0))


def format_duration(secs: float | None, *, slurm_style: bool = False) -> str:
    if secs is None:
        return "-"
    s = int(round(secs))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if slurm_style:
        hms = f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
        return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else hms
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


# --------------------------------------------------------------------------- status rows (pure)


@dataclass
class StatusRow:
    """One line of `lmlaunch status` (and one object of `status --json`)."""

    name: str
    job_id: str | None
    state: str  # SLURM state word, a marker's verdict, or "unknown (SLURM unreachable)"
    group: str  # queued | running | completed | preempted | cancelled | failed | timeout | unknown
    reason: str | None  # why it is pending (Priority, Resources, BeginTime, Dependency ...)
    requeued: bool
    nodes: int | None
    elapsed: str | None
    time_limit: str | None
    attempt: int
    step: int | None
    max_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    mfu: float | None
    checkpoint_step: int | None
    checkpoint_age_s: float | None
    eta_s: float | None
    heartbeat_age_s: float | None
    run_dir: str
    job_ids: list[str]
    note: str = ""

    @property
    def progress(self) -> float | None:
        if self.step is None or not self.max_steps:
            return None
        return min(1.0, self.step / self.max_steps)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["progress"] = self.progress
        return d


def attempt_number(ledger: Sequence[Mapping[str, Any]], job: SlurmJob | None) -> int:
    """The attempt now queued, running or last run, counted over the whole run (1-based).

    The ledger counts the attempts that started (every job id of the run); SLURM knows
    requeues of the current job that have not started (yet): pending after preemption, the
    runtime killed before it could write.
    """
    starts = [e for e in ledger if e.get("event") == "start"]
    started = max([int(e.get("attempt") or 0) for e in starts] + [len(starts)])
    if job is None:
        return started
    of_job = sum(1 for e in starts if str(e.get("job_id")) == job.job_id)
    return started + max(0, job.attempts - of_job)


def rate_steps_per_s(beats: Sequence[Mapping[str, Any]]) -> float | None:
    """Steps per second over the step lines of the last attempt in the heartbeat tail."""
    steps = [b for b in beats if b.get("event") == "step" and b.get("step") is not None and b.get("time")]
    if len(steps) < 2:
        return None
    last = steps[-1]
    same = [b for b in steps if b.get("attempt") == last.get("attempt")]
    first = same[0]
    dt = float(last["time"]) - float(first["time"])
    ds = int(last["step"]) - int(first["step"])
    if dt <= 0 or ds <= 0:
        return None
    return ds / dt


def build_row(rec: Any, files: RunFiles, job: SlurmJob | None, *, slurm_reachable: bool, now: float) -> StatusRow:
    """Pure: registry record + run-directory readings + SLURM's view of the current job -> a row."""
    beats = files.heartbeat
    last_step = next((b for b in reversed(beats) if b.get("event") == "step"), None)
    last_any_step = next((b for b in reversed(beats) if b.get("step") is not None), None)
    max_steps = rec.max_steps
    for b in reversed(beats):
        if b.get("max_steps"):
            max_steps = int(b["max_steps"])
            break

    requeued = bool(job and job.attempts > 1)
    reason = None
    note = ""
    if not slurm_reachable:
        state, group = UNREACHABLE, "unknown"
        if files.done:
            note = "DONE marker: reached max_steps"
        elif files.cancelled or rec.state == "cancelled":
            note = "CANCELLED marker"
    elif job is not None:
        from launcher.slurm import state_group

        state, group = job.state, state_group(job.state)
        if group == "queued" and job.reason and job.reason != "None":
            reason = job.reason
        if requeued and group == "queued":
            note = "requeued, waiting to restart"
        if files.cancelled and group in ("queued", "running"):
            note = "cancel requested"
    elif files.done:
        state, group, note = "COMPLETED", "completed", "DONE marker (SLURM has no record of the job)"
    elif files.cancelled or rec.state == "cancelled":
        state, group, note = "CANCELLED", "cancelled", "CANCELLED marker (SLURM has no record of the job)"
    elif rec.job_ids:
        state, group, note = "UNKNOWN", "unknown", "neither squeue nor sacct knows the job"
    else:
        state, group, note = "NOT SUBMITTED", "unknown", ""
    if not files.exists:
        note = (note + "; " if note else "") + f"run directory missing: {rec.run_dir}"

    step = int(last_any_step["step"]) if last_any_step is not None else None
    attempt = attempt_number(files.ledger, job if slurm_reachable else None)
    if attempt == 0 and job is not None:
        attempt = 1
    rate = rate_steps_per_s(beats)
    eta = None
    if group == "running" and rate and step is not None and max_steps:
        eta = max(0.0, (max_steps - step) / rate)
    hb_time = float(beats[-1]["time"]) if beats and beats[-1].get("time") else None
    ck = files.checkpoint
    time_limit = job.time_limit if job and job.time_limit else files.plan_time
    return StatusRow(
        name=rec.name,
        job_id=rec.job_ids[-1] if rec.job_ids else None,
        state=state,
        group=group,
        reason=reason,
        requeued=requeued,
        nodes=job.num_nodes if job and job.num_nodes else None,
        elapsed=job.elapsed if job and job.elapsed else None,
        time_limit=_normalize_limit(time_limit),
        attempt=attempt,
        step=step,
        max_steps=max_steps,
        loss=_num(last_step, "loss"),
        tokens_per_s=_num(last_step, "tokens_per_s"),
        mfu=_num(last_step, "mfu"),
        checkpoint_step=ck.step if ck else None,
        checkpoint_age_s=max(0.0, now - ck.mtime) if ck else None,
        eta_s=eta,
        heartbeat_age_s=max(0.0, now - hb_time) if hb_time else None,
        run_dir=rec.run_dir,
        job_ids=list(rec.job_ids),
        note=note,
    )


def _normalize_limit(text: str | None) -> str | None:
    if not text:
        return None
    secs = parse_slurm_duration(text)
    return format_duration(secs, slurm_style=True) if secs is not None else text


def _num(d: Mapping[str, Any] | None, key: str) -> float | None:
    if d is None:
        return None
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def is_recent_or_active(row: StatusRow, rec: Any, now: float, days: float = 1.0) -> bool:
    """What `status` shows without --all: runs still queued/running, or submitted in the last day."""
    if row.group in ("queued", "running") or row.state == UNREACHABLE:
        return True
    last = rec.submitted_at[-1] if rec.submitted_at else 0.0
    return now - last < days * 86400


def gather_status(
    records: Sequence[Any],
    *,
    environ: Mapping[str, str] | None = None,
    now: float | None = None,
) -> tuple[list[StatusRow], SlurmView]:
    """Rows for ``records``: one squeue (+ at most one sacct) call, run directories read while
    SLURM answers (the two overlap: SLURM's answer is a subprocess wait); a run directory whose
    files have not changed since the last call is not read again (launcher/status_cache.py)."""
    import threading

    now = time.time() if now is None else now
    ids = [r.last_job_id for r in records if r.last_job_id]
    result: dict[str, SlurmView] = {}
    t = threading.Thread(target=lambda: result.setdefault("v", query_slurm(ids, environ=environ)))
    t.start()
    from launcher import status_cache  # unchanged run directories are not read again

    files = status_cache.read_all([r.run_dir for r in records], environ)
    t.join()
    view = result["v"]
    rows = [
        build_row(r, f, view.jobs.get(r.last_job_id or ""), slurm_reachable=view.reachable, now=now)
        for r, f in zip(records, files)
    ]
    return rows, view


# --------------------------------------------------------------------------- history (pure + one sacct -D)


@dataclass
class AttemptRow:
    """One attempt of a run, from the ledger (and sacct -D for its queue wait)."""

    attempt: int
    job_id: str | None
    nodes: list[str]
    start_time: float | None
    end_time: float | None
    start_step: int | None
    end_step: int | None
    reason: str  # the ledger's end reason, or "unknown" (no end line: SIGKILL, node lost) / "running"
    detail: str
    requeued: bool
    steps_lost: int | None  # end_step of this attempt - start_step of the next (work redone)
    queue_wait_s: float | None  # SLURM Submit -> Start of this attempt
    train_s: float | None  # time spent in training steps (heartbeat: first to last step line)
    alloc_s: float | None  # allocated time of the attempt (ledger start -> end, or sacct elapsed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class History:
    name: str
    attempts: list[AttemptRow]
    goodput: float | None  # sum(train_s) / sum(alloc_s)
    steps_lost_total: int
    queue_wait_total_s: float | None
    cancel_requested: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "goodput": self.goodput,
            "steps_lost_total": self.steps_lost_total,
            "queue_wait_total_s": self.queue_wait_total_s,
            "cancel_requested": self.cancel_requested,
            "notes": self.notes,
            "attempts": [a.to_dict() for a in self.attempts],
        }


def parse_sacct_time(text: str) -> float | None:
    """sacct's local ISO time (2026-11-23T09:15:35) -> epoch seconds; Unknown/None -> None."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None


def build_history(
    name: str,
    ledger: Sequence[Mapping[str, Any]],
    heartbeat: Sequence[Mapping[str, Any]],
    sacct_attempts: Mapping[str, Sequence[tuple[float | None, float | None, float | None]]] | None = None,
    *,
    now: float | None = None,
) -> History:
    """Pure: the ledger (+ the whole heartbeat, + sacct's (submit, start, end) per attempt of
    each job id, in order) -> one row per attempt with goodput, steps lost and queue wait."""
    now = time.time() if now is None else now
    starts = [e for e in ledger if e.get("event") == "start"]
    ends: dict[int, Mapping[str, Any]] = {}
    for e in ledger:
        if e.get("event") == "end" and e.get("attempt") is not None:
            ends[int(e["attempt"])] = e
    cancel = next((float(e["time"]) for e in ledger if e.get("event") == "cancel_requested" and e.get("time")), None)

    # training time per attempt: from each attempt's first to last step line in the heartbeat
    spans: dict[int, list[float]] = {}
    for b in heartbeat:
        if b.get("event") in ("start", "step") and b.get("attempt") is not None and b.get("time"):
            spans.setdefault(int(b["attempt"]), []).append(float(b["time"]))

    per_job_index: dict[str, int] = {}
    rows: list[AttemptRow] = []
    for i, s in enumerate(starts):
        n = int(s.get("attempt") or i + 1)
        e = ends.get(n)
        jid = str(s["job_id"]) if s.get("job_id") is not None else None
        k = per_job_index.get(jid or "", 0)
        per_job_index[jid or ""] = k + 1
        q = None
        alloc_sacct = None
        if sacct_attempts and jid in sacct_attempts and k < len(sacct_attempts[jid]):
            sub, st, en = sacct_attempts[jid][k]
            if sub is not None and st is not None:
                q = max(0.0, st - sub)
            if st is not None and en is not None:
                alloc_sacct = max(0.0, en - st)
        t0 = float(s["time"]) if s.get("time") else None
        t1 = float(e["time"]) if e and e.get("time") else None
        is_last = i == len(starts) - 1
        if e is not None:
            reason = str(e.get("reason") or "unknown")
        else:
            reason = "running" if is_last and cancel is None and _heartbeat_fresh(spans.get(n), now) else "unknown"
        if t1 is None and reason == "running":
            t1 = now
        if t1 is None and spans.get(n):
            t1 = max(spans[n])  # died without an end line: the last sign of life
        alloc = alloc_sacct if alloc_sacct is not None else ((t1 - t0) if t0 is not None and t1 is not None else None)
        train = None
        if spans.get(n) and len(spans[n]) >= 2:
            train = max(spans[n]) - min(spans[n])
        rows.append(AttemptRow(
            attempt=n, job_id=jid, nodes=list(s.get("nodes") or []), start_time=t0, end_time=t1,
            start_step=_int(s.get("start_step")), end_step=_int(e.get("end_step")) if e else None,
            reason=reason, detail=str(e.get("detail") or "") if e else "",
            requeued=bool(e.get("requeued")) if e else False, steps_lost=None, queue_wait_s=q,
            train_s=train, alloc_s=alloc,
        ))
    # steps lost: what the next attempt had to redo
    for a, b in zip(rows, rows[1:]):
        end = a.end_step
        if end is None:
            end = _last_step_of(heartbeat, a.attempt)
        if end is not None and b.start_step is not None:
            a.steps_lost = max(0, end - b.start_step)
    trains = [a.train_s for a in rows if a.train_s is not None]
    allocs = [a.alloc_s for a in rows if a.alloc_s is not None]
    goodput = (sum(trains) / sum(allocs)) if trains and allocs and sum(allocs) > 0 else None
    waits = [a.queue_wait_s for a in rows if a.queue_wait_s is not None]
    notes = []
    if not starts:
        notes.append("no attempt has started yet (the ledger attempts.jsonl is empty)")
    return History(
        name=name,
        attempts=rows,
        goodput=min(1.0, goodput) if goodput is not None else None,
        steps_lost_total=sum(a.steps_lost or 0 for a in rows),
        queue_wait_total_s=sum(waits) if waits else None,
        cancel_requested=cancel,
        notes=notes,
    )


def _heartbeat_fresh(times: list[float] | None, now: float, within_s: float = 600.0) -> bool:
    return bool(times) and now - max(times) < within_s


def _last_step_of(heartbeat: Sequence[Mapping[str, Any]], attempt: int) -> int | None:
    steps = [int(b["step"]) for b in heartbeat if b.get("attempt") == attempt and b.get("step") is not None]
    return max(steps) if steps else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def sacct_attempt_times(job_ids: Sequence[str]) -> tuple[dict[str, list[tuple[float | None, float | None, float | None]]], str]:
    """ONE `sacct -D` call: (submit, start, end) of every attempt of every job, in order.
    Returns the map and a message ('' when accounting answered)."""
    from launcher import slurm
    from launcher.errors import SlurmUnavailable, UserError

    try:
        rows = slurm.sacct(list(job_ids), duplicates=True)
    except (SlurmUnavailable, UserError) as exc:
        return {}, exc.message
    out: dict[str, list[tuple[float | None, float | None, float | None]]] = {}
    for r in rows:
        out.setdefault(r.job_id, []).append((parse_sacct_time(r.submit), parse_sacct_time(r.start), parse_sacct_time(r.end)))
    return out, ""


# --------------------------------------------------------------------------- logs (pure listing)


@dataclass(frozen=True)
class LogSource:
    """One file to show: an attempt's rank log, or submitit's per-task file of a job."""

    attempt: int | None
    job_id: str | None
    path: Path
    label: str


def attempt_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    try:
        for p in (run_dir / "logs").iterdir():
            m = re.fullmatch(r"attempt-(\d+)", p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    except OSError:
        return []
    return sorted(out)


def log_sources(run_dir: Path, job_ids: Sequence[str], *, rank: int = 0, attempt: int | None = None) -> list[LogSource]:
    """The files of ``rank`` for every attempt in order (or only ``attempt``); submitit's
    ``%j_%t_log.out/.err`` of each job when an attempt has no log of its own."""
    out = []
    for n, d in attempt_dirs(run_dir):
        if attempt is not None and n != attempt:
            continue
        p = d / f"rank-{rank}.log"
        if p.exists():
            out.append(LogSource(n, None, p, f"attempt {n}, rank {rank}"))
    if out or (attempt is not None and attempt_dirs(run_dir)):
        return out
    sub = run_dir / "submitit"
    for jid in job_ids:
        for ext in ("out", "err"):
            p = sub / f"{jid}_{rank}_log.{ext}"
            if p.exists():
                out.append(LogSource(None, jid, p, f"job {jid}, task {rank}, submitit {ext}"))
    return out


_ERROR_LINE = re.compile(
    r"(Traceback \(most recent call last\)|\b[A-Z][A-Za-z]*(Error|Exception)\b|\bERROR\b|\bCRITICAL\b|\bFATAL\b|"
    r"srun: error|slurmstepd: error|\bKilled\b|OOM|out of memory|DUE TO (TIME LIMIT|PREEMPTION)|CANCELLED AT)"
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
        bits.append(f"job {start.get('job_id')}")
        if start.get("nodes"):
            bits.append("on " + ",".join(start["nodes"]))
        if start.get("start_step") is not None:
            bits.append(f"from step {start['start_step']}")
        if start.get("time"):
            bits.append("started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(start["time"]))))
    if end:
        bits.append(f"ended {end.get('reason')} at step {end.get('end_step')}")
    return f"──── {' · '.join(bits)} ────"
