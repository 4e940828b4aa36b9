"""What `lmlaunch status` and `history` show about runs, as row models (no rendering here:
launcher/monitor_view.py draws them; no reading either: launcher/run_files.py reads the run
directories, launcher/slurm_view.py asks SLURM). Pure functions from those readings to rows,
so renderers and tests work on synthetic run directories."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher import status_cache
from launcher.core import rundir, slurm
from launcher.run_files import RunFiles
from launcher.slurm_view import UNREACHABLE, SlurmJob, SlurmView, format_duration, query_slurm

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


# The SLURM state a job that ended so would have (for a job the controller forgot, without sacct).
_STATE_OF_REASON = {"completed": "COMPLETED", "cancelled": "CANCELLED", "timeout": "TIMEOUT",
                    "preempted": "PREEMPTED", "node_failure": "NODE_FAIL"}


def last_end_of(ledger: Sequence[Mapping[str, Any]], job_id: str) -> Mapping[str, Any] | None:
    """The end line of ``job_id``'s last attempt, when that attempt is the run's last one."""
    last = next((e for e in reversed(ledger) if e.get("event") in ("start", "end")), None)
    if last is None or last.get("event") != "end" or str(last.get("job_id")) != str(job_id):
        return None
    return last


def ended_state(end: Mapping[str, Any]) -> str:
    """The SLURM-like state of an attempt's end line: its reason, or for a limit reached
    (max_timeouts, max_preemptions, ...) the stop that reached it ("timeout: SIGUSR2 ...")."""
    reason = str(end.get("reason") or "")
    if reason == "limit_reached":
        reason = str(end.get("detail") or "").split(":", 1)[0]
    return _STATE_OF_REASON.get(reason, "FAILED")


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
        state, group = job.state, slurm.state_group(job.state)
        if group == "queued" and job.reason and job.reason != "None":
            reason = job.reason
        if requeued and group == "queued":
            note = "requeued, waiting to restart"
            if files.done:  # SLURM 24.11 requeues a job preempted once more after it ended (docs/architecture.md)
                note = "finished (DONE marker), yet requeued by SLURM: that start ends at once, training nothing"
        upstream = ", ".join(getattr(rec, "after", None) or []) or "another job"
        if group == "queued" and job.reason == "Dependency":
            note = f"waiting for {upstream} (--after)"
        elif group == "queued" and job.reason == "DependencyNeverSatisfied":
            note = f"never starts: {upstream} did not succeed (`lmlaunch cancel {rec.name}`)"
        if files.cancelled and group in ("queued", "running"):
            note = "cancel requested"
    elif files.done:
        state, group, note = "COMPLETED", "completed", "DONE marker (SLURM has no record of the job)"
    elif files.cancelled or rec.state == "cancelled":
        state, group, note = "CANCELLED", "cancelled", "CANCELLED marker (SLURM has no record of the job)"
    elif rec.job_ids and (ended := last_end_of(files.ledger, rec.job_ids[-1])) is not None:
        state, note = ended_state(ended), (
            f"attempt {ended.get('attempt')} ended {ended.get('reason')}, "
            + ("asked to be requeued, but SLURM has no record of the job" if ended.get("requeued")
               else "not requeued (run directory; SLURM has no record of the job)"))
        state = "UNKNOWN" if ended.get("requeued") else state
        group = slurm.state_group(state)
    elif rec.job_ids:
        state, group, note = "UNKNOWN", "unknown", "neither squeue nor sacct knows the job"
    else:
        state, group, note = "NOT SUBMITTED", "unknown", ""
    if not files.exists:
        note = (note + "; " if note else "") + f"run directory missing: {rec.run_dir}"
    ev = next((e for e in reversed(files.ledger) if e.get("event") == "eval"), None)  # an eval run's result
    if ev is not None:
        last_step, note = {"loss": ev.get("val_loss")}, "; ".join(x for x in (
            f"eval of step-{ev.get('step')}: val_loss {_num(ev, 'val_loss') or 0:.4f}, perplexity "
            f"{_num(ev, 'perplexity') or 0:.2f}", note) if x)

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
    secs = slurm.parse_duration(text)
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
class HistoryRow:
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
    # seconds per startup phase (rundir.STARTUP_PHASES; "launch": allocation start -> process start)
    startup: dict[str, float] | None = None
    startup_total_s: float | None = None  # allocation (or process) start -> first step done
    checkpoint_bytes: int | None = None  # the checkpoint the attempt resumed from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class History:
    name: str
    attempts: list[HistoryRow]
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
    for line in ledger:
        if line.get("event") == "end" and line.get("attempt") is not None:
            ends[int(line["attempt"])] = line
    cancel = next((float(x["time"]) for x in ledger if x.get("event") == "cancel_requested" and x.get("time")), None)
    startups = {int(x["attempt"]): x for x in ledger if x.get("event") == "startup" and isinstance(x.get("attempt"), int)}

    # training time per attempt: from each attempt's first to last step line in the heartbeat
    spans: dict[int, list[float]] = {}
    for b in heartbeat:
        if b.get("event") in ("start", "step") and b.get("attempt") is not None and b.get("time"):
            spans.setdefault(int(b["attempt"]), []).append(float(b["time"]))

    per_job_index: dict[str, int] = {}
    rows: list[HistoryRow] = []
    for i, s in enumerate(starts):
        n = int(s.get("attempt") or i + 1)
        e: Mapping[str, Any] | None = ends.get(n)
        jid = str(s["job_id"]) if s.get("job_id") is not None else None
        k = per_job_index.get(jid or "", 0)
        per_job_index[jid or ""] = k + 1
        q = None
        alloc_sacct = None
        alloc_start = None
        if sacct_attempts and jid is not None and jid in sacct_attempts and k < len(sacct_attempts[jid]):
            sub, st, en = sacct_attempts[jid][k]
            alloc_start = st
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
        row = HistoryRow(
            attempt=n, job_id=jid, nodes=list(s.get("nodes") or []), start_time=t0, end_time=t1,
            start_step=_int(s.get("start_step")), end_step=_int(e.get("end_step")) if e else None,
            reason=reason, detail=str(e.get("detail") or "") if e else "",
            requeued=bool(e.get("requeued")) if e else False, steps_lost=None, queue_wait_s=q,
            train_s=train, alloc_s=alloc,
        )
        rows.append(row)
        if n in startups:
            row.startup = rundir.startup_breakdown(startups[n], alloc_start)
            row.startup_total_s = round(sum(row.startup.values()), 3) if "first_step" in startups[n].get("phases", {}) else None
            row.checkpoint_bytes = _int(startups[n].get("checkpoint_bytes"))
    # steps lost: what the next attempt had to redo
    for row, nxt in zip(rows, rows[1:]):
        end = row.end_step
        if end is None:
            end = _last_step_of(heartbeat, row.attempt)
        if end is not None and nxt.start_step is not None:
            row.steps_lost = max(0, end - nxt.start_step)
    trains = [a.train_s for a in rows if a.train_s is not None]
    allocs = [a.alloc_s for a in rows if a.alloc_s is not None]
    goodput = (sum(trains) / sum(allocs)) if trains and allocs and sum(allocs) > 0 else None
    waits = [a.queue_wait_s for a in rows if a.queue_wait_s is not None]
    notes = []
    if not starts:
        notes.append("no attempt has started yet (the ledger attempts.jsonl is empty)")
    for x in ledger:  # what rank 0 did to the job after an attempt (lmtrain.bad_nodes, lmtrain.preemption)
        what = {"nodes_excluded": f"job {x.get('job_id')} keeps off {','.join(x.get('nodes') or [])} (ExcNodeList)",
                **{k: f"{k.replace('_', ' ')}: {x.get('detail', '')}" for k in
                   ("exclude_failed", "requeue_failed", "cancel_failed")}}.get(str(x.get("event")))
        if what:
            notes.append(f"after attempt {x.get('attempt')}: {what}")
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
    return bool(times) and times is not None and now - max(times) < within_s


def _last_step_of(heartbeat: Sequence[Mapping[str, Any]], attempt: int) -> int | None:
    steps = [int(b["step"]) for b in heartbeat if b.get("attempt") == attempt and b.get("step") is not None]
    return max(steps) if steps else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
