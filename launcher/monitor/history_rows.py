"""What `lmlaunch history` shows about a run's attempts, as row models: pure functions from the
ledger, the heartbeat and sacct's attempts to rows (launcher/monitor/view.py draws them;
launcher/monitor/status_rows.py does the same for `status`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lmcore.run import rundir, straggler_lines

# sacct's figures of one attempt: (submit, start, end) as epoch seconds, then the GPUs it held
AttemptTimes = tuple[float | None, ...]


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
    world_size: int | None = None
    held_bytes: int | None = None  # the most model states (params + grads + optimizer) a rank held (ledger "memory")
    device_peak: int | None = None  # the most device memory a rank allocated (CUDA's max allocated), where kept
    cluster: str | None = None  # the cluster profile of its job, for a run whose jobs went to several
    profile: str | None = None  # the profile its ranks were planned on (the start line's; a copy over SSH: that side's name)
    gpus: int | None = None  # the GPUs the attempt held: its ledger start line's, else sacct's AllocTRES (None: a CPU job)
    gpu_hours: float | None = None  # gpus x its allocated hours
    train_gpu_hours: float | None = None  # gpus x its hours in training steps

    def set_gpus(self, gpus: int | None) -> None:
        self.gpus = gpus
        if gpus:
            self.gpu_hours = round(gpus * self.alloc_s / 3600, 6) if self.alloc_s is not None else None
            self.train_gpu_hours = round(gpus * self.train_s / 3600, 6) if self.train_s is not None else None

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
    planned_memory: dict[str, Any] | None = None  # plan.json's memory (launcher.planning.memory.Breakdown.to_json)
    eval: list[dict[str, Any]] = field(default_factory=list)  # the evaluator's scores: step, task, metric, value, stderr, lm_eval
    gpu_hours: float | None = None  # every attempt's allocated GPU-hours (its GPUs x its allocated time); None: no GPUs known
    train_gpu_hours: float | None = None  # of them, the hours in training steps (goodput in GPU-hours)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "goodput": self.goodput,
            "steps_lost_total": self.steps_lost_total,
            "queue_wait_total_s": self.queue_wait_total_s,
            "cancel_requested": self.cancel_requested,
            "notes": self.notes,
            "planned_memory": self.planned_memory,
            "attempts": [a.to_dict() for a in self.attempts],
            "eval": self.eval,
            "gpu_hours": self.gpu_hours,
            "train_gpu_hours": self.train_gpu_hours,
        }


def build_history(
    name: str,
    ledger: Sequence[Mapping[str, Any]],
    heartbeat: Sequence[Mapping[str, Any]],
    sacct_attempts: Mapping[str, Sequence[AttemptTimes]] | None = None,
    *,
    now: float | None = None,
) -> History:
    """Pure: the ledger (+ the whole heartbeat, + sacct's (submit, start, end[, GPUs]) per attempt of
    each job id, in order) -> one row per attempt with goodput, steps lost, queue wait and GPU-hours."""
    now = time.time() if now is None else now
    starts = [e for e in ledger if e.get("event") == "start"]
    ends: dict[int, Mapping[str, Any]] = {}
    for line in ledger:
        if line.get("event") == "end" and line.get("attempt") is not None:
            ends[int(line["attempt"])] = line
    cancel = next((float(x["time"]) for x in ledger if x.get("event") == "cancel_requested" and x.get("time")), None)
    startups = {int(x["attempt"]): x for x in ledger if x.get("event") == "startup" and isinstance(x.get("attempt"), int)}
    measured = memory_lines(ledger)
    spans = _training_spans(heartbeat)
    per_job_index: dict[str, int] = {}
    rows: list[HistoryRow] = []
    for i, s in enumerate(starts):
        n = int(s.get("attempt") or i + 1)
        jid = str(s["job_id"]) if s.get("job_id") is not None else None
        k = per_job_index.get(jid or "", 0)
        per_job_index[jid or ""] = k + 1
        allocation = _allocation(sacct_attempts, jid, k)
        still_running = i == len(starts) - 1 and cancel is None and _heartbeat_fresh(spans.get(n), now)
        row = _attempt_row(n, s, ends.get(n), spans.get(n), allocation, still_running, now)
        row.held_bytes, row.device_peak = measured.get(n, (None, None))
        # what the attempt held by its start line (its nodes and spares: a restart in place on a spare
        # holds fewer than the allocation began with), else by sacct's AllocTRES (the allocation's last shape)
        row.set_gpus(_int(s.get("gpus")) or _gpus(sacct_attempts, jid, k))
        if n in startups:
            row.startup = rundir.startup_breakdown(startups[n], allocation[2])
            row.startup_total_s = round(sum(row.startup.values()), 3) if "first_step" in startups[n].get("phases", {}) else None
            row.checkpoint_bytes = _int(startups[n].get("checkpoint_bytes"))
        rows.append(row)
    _count_steps_lost(rows, heartbeat)
    trains = [a.train_s for a in rows if a.train_s is not None]
    allocs = [a.alloc_s for a in rows if a.alloc_s is not None]
    goodput = (sum(trains) / sum(allocs)) if trains and allocs and sum(allocs) > 0 else None
    waits = [a.queue_wait_s for a in rows if a.queue_wait_s is not None]
    gpu_rows = [a for a in rows if a.gpu_hours is not None]
    notes = ["no attempt has started yet (the ledger attempts.jsonl is empty)"] if not starts else []
    return History(
        name=name,
        attempts=rows,
        goodput=min(1.0, goodput) if goodput is not None else None,
        steps_lost_total=sum(a.steps_lost or 0 for a in rows),
        queue_wait_total_s=sum(waits) if waits else None,
        cancel_requested=cancel,
        notes=notes + _ledger_notes(ledger),
        gpu_hours=round(sum(a.gpu_hours or 0.0 for a in gpu_rows), 6) if gpu_rows else None,
        train_gpu_hours=round(sum(a.train_gpu_hours or 0.0 for a in gpu_rows), 6) if gpu_rows else None,
    )


def _training_spans(heartbeat: Sequence[Mapping[str, Any]]) -> dict[int, list[float]]:
    """attempt -> the times of its start and step lines in the heartbeat (its training time runs
    from the first to the last)."""
    spans: dict[int, list[float]] = {}
    for b in heartbeat:
        if b.get("event") in ("start", "step") and b.get("attempt") is not None and b.get("time"):
            spans.setdefault(int(b["attempt"]), []).append(float(b["time"]))
    return spans


def _gpus(sacct_attempts: Mapping[str, Sequence[AttemptTimes]] | None, jid: str | None, k: int) -> int | None:
    """The GPUs sacct says the ``k``-th attempt of job ``jid`` held (AllocTRES), None when it says none."""
    if not sacct_attempts or jid is None or k >= len(sacct_attempts.get(jid, ())):
        return None
    figures = sacct_attempts[jid][k]
    return int(figures[3]) if len(figures) > 3 and figures[3] is not None else None


def _allocation(sacct_attempts: Mapping[str, Sequence[AttemptTimes]] | None,
                jid: str | None, k: int) -> tuple[float | None, float | None, float | None]:
    """sacct's figures of the ``k``-th attempt of job ``jid``: (queue wait, allocation seconds,
    allocation start); Nones where accounting has none."""
    if not sacct_attempts or jid is None or jid not in sacct_attempts or k >= len(sacct_attempts[jid]):
        return None, None, None
    sub, st, en = sacct_attempts[jid][k][:3]
    wait = max(0.0, st - sub) if sub is not None and st is not None else None
    alloc = max(0.0, en - st) if st is not None and en is not None else None
    return wait, alloc, st


def _attempt_row(n: int, start: Mapping[str, Any], end: Mapping[str, Any] | None, span: list[float] | None,
                 allocation: tuple[float | None, float | None, float | None], still_running: bool,
                 now: float) -> HistoryRow:
    """One attempt's row from its ledger start and end lines, its heartbeat span and sacct's figures."""
    t0 = float(start["time"]) if start.get("time") else None
    t1 = float(end["time"]) if end and end.get("time") else None
    if end is not None:
        reason = str(end.get("reason") or "unknown")
    else:
        reason = "running" if still_running else "unknown"
    if t1 is None and reason == "running":
        t1 = now
    if t1 is None and span:
        t1 = max(span)  # died without an end line: the last sign of life
    wait, alloc_sacct, _ = allocation
    alloc = alloc_sacct if alloc_sacct is not None else ((t1 - t0) if t0 is not None and t1 is not None else None)
    row = HistoryRow(
        attempt=n, job_id=str(start["job_id"]) if start.get("job_id") is not None else None,
        nodes=list(start.get("nodes") or []), start_time=t0, end_time=t1,
        start_step=_int(start.get("start_step")), end_step=_int(end.get("end_step")) if end else None,
        reason=reason, detail=str(end.get("detail") or "") if end else "",
        requeued=bool(end.get("requeued")) if end else False, steps_lost=None, queue_wait_s=wait,
        train_s=max(span) - min(span) if span and len(span) >= 2 else None, alloc_s=alloc,
    )
    row.world_size = _int(start.get("world_size"))
    row.profile = str(start["profile"]) if start.get("profile") else None
    return row


def _count_steps_lost(rows: list[HistoryRow], heartbeat: Sequence[Mapping[str, Any]]) -> None:
    """Each attempt's steps lost: what the next attempt had to redo."""
    for row, nxt in zip(rows, rows[1:]):
        end = row.end_step
        if end is None:
            end = _last_step_of(heartbeat, row.attempt)
        if end is not None and nxt.start_step is not None:
            row.steps_lost = max(0, end - nxt.start_step)


def _ledger_notes(ledger: Sequence[Mapping[str, Any]]) -> list[str]:
    """What rank 0 did to the job after an attempt (lmtrain.preemption.bad_nodes, lmtrain.preemption),
    the checkpoints a resume rejected (lmtrain.checkpoint.resume_point) and the ranks found slow and
    no longer slow (lmtrain.health.straggler_watch)."""
    notes = []
    for x in ledger:
        what = {"nodes_excluded": f"job {x.get('job_id')} keeps off {','.join(x.get('nodes') or [])} (ExcNodeList)",
                **{k: f"{k.replace('_', ' ')}: {x.get('detail', '')}" for k in
                   ("exclude_failed", "requeue_failed", "cancel_failed")}}.get(str(x.get("event")))
        if what:
            notes.append(f"after attempt {x.get('attempt')}: {what}")
        elif x.get("event") == "checkpoint_rejected":  # before it loaded anything
            instead = f"resumed from {x['fallback']} instead" if x.get("fallback") else "no older checkpoint was left"
            notes.append(f"attempt {x.get('attempt')}: step-{x.get('step')} failed its checksums "
                         f"({x.get('detail', '')}); {instead}")
        elif x.get("event") in ("moved", "move_failed", "move_abandoned"):  # launcher.submit.mover: several clusters
            notes.append(_move_note(x))
        elif x.get("event") == "end" and isinstance(x.get("bucket"), dict) and not x["bucket"].get("uploaded", True):
            b = x["bucket"]  # lmtrain.checkpoint.store_mirror: its newest checkpoint's upload failed
            notes.append(f"attempt {x.get('attempt')}: its last checkpoint step-{b.get('step')} is not in "
                         f"{b.get('store')} ({b.get('error')}): on that cluster's disk only; the next attempt there "
                         "uploads it")
        elif x.get("event") == "straggler":  # lmtrain.health.straggler_watch
            said = straggler_lines.describe(x)
            if x.get("state") == "start":
                notes.append(f"attempt {x.get('attempt')}: from step {x.get('step')}, slow: {said}")
            else:
                notes.append(f"attempt {x.get('attempt')}: from step {x.get('step')}, rank {x.get('rank')} "
                             f"({x.get('node')}) no longer slow (it was {said.split(') ', 1)[1]})")
    return notes + restart_notes(ledger)


def _move_note(x: Mapping[str, Any]) -> str:
    """A move between clusters, as the watcher recorded it."""
    import time

    when = time.strftime("%m-%d %H:%M:%S", time.localtime(float(x.get("time") or 0)))
    if x.get("event") == "moved":
        return (f"{when}: moved from {x.get('from')} (job {x.get('from_job')}, queued) to {x.get('to')} "
                f"(job {x.get('to_job')}): {x.get('why')}" + (f"; {x['checkpoint']}" if x.get("checkpoint") else ""))
    if x.get("event") == "move_abandoned":
        return (f"{when}: a move from {x.get('from')} (job {x.get('from_job')}) to {x.get('to')} was abandoned "
                f"({x.get('error')}); the job stayed queued there")
    return (f"{when}: a move from {x.get('from')} (job {x.get('from_job')}) to {x.get('to')} failed "
            f"({x.get('error')}); queued again on {x.get('from')} as job {x.get('job')}")


def restart_notes(ledger: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each restart in place (lmtrain.preemption: the ranks started again in the same allocation),
    and how long from the failed attempt's end line to the next attempt's first step."""
    firsts: dict[Any, float] = {}
    for x in ledger:  # the startup record: when the process started, and its first step's offset
        phases = x.get("phases")
        first = phases.get("first_step") if isinstance(phases, dict) else None
        if x.get("event") == "startup" and isinstance(x.get("process_start"), (int, float)) \
                and isinstance(first, (int, float)):
            firsts[x.get("attempt")] = float(x["process_start"]) + float(first)
    notes = []
    for x in ledger:
        if x.get("event") != "end" or x.get("restart") != "in_place" or not isinstance(x.get("attempt"), int):
            continue
        nxt, ended = x["attempt"] + 1, x.get("time")
        first = firsts.get(nxt)
        took = (f"its first step {first - float(ended):.1f} s after attempt {x['attempt']}'s end line"
                if first is not None and isinstance(ended, (int, float)) else "no step of it recorded yet")
        notes.append(f"attempt {nxt}: restarted in place after attempt {x['attempt']} {x.get('reason')} at step "
                     f"{x.get('end_step')} (same job and nodes, no queue wait); {took}")
    return notes


def planned_memory_line(ledger: Sequence[Mapping[str, Any]]) -> tuple[int | None, int | None]:
    """(one rank's planned model states, planned peak) as the newest ``memory`` line carries them
    (lmtrain.task.fit.planned_memory; older runs' lines have none)."""
    for x in reversed(ledger):
        planned = x.get("planned") if x.get("event") == "memory" else None
        if isinstance(planned, Mapping):
            states, peak = planned.get("model_states"), planned.get("peak")
            return (states if isinstance(states, int) else None), (peak if isinstance(peak, int) else None)
    return None, None


def memory_lines(ledger: Sequence[Mapping[str, Any]]) -> dict[int, tuple[int | None, int | None]]:
    """attempt -> (the most model-state bytes a rank held, the highest device peak), from the
    ledger's ``memory`` lines (lmtrain.model.memory_held)."""
    out: dict[int, tuple[int | None, int | None]] = {}
    for x in ledger:
        if x.get("event") != "memory" or not isinstance(x.get("attempt"), int):
            continue
        held, peak = out.get(x["attempt"], (None, None))
        ranks = x.get("held")
        if isinstance(ranks, list) and ranks and all(isinstance(r, dict) for r in ranks):
            held = max(sum(int(r.get(k) or 0) for k in ("params", "grads", "optimizer")) for r in ranks)
        peaks = [p for p in (x.get("device_peak") or []) if isinstance(p, int)] if isinstance(x.get("device_peak"), list) else []
        if peaks:
            peak = max(peaks)
        out[x["attempt"]] = (held, peak)
    return out


def memory_notes(h: History, planned: Mapping[str, Any] | None, planned_world: int | None) -> list[str]:
    """Estimate against measurement, one line per measured attempt (``history``)."""
    from launcher.planning.memory import gb
    from lmcore.job.plan import planned_model_states  # pydantic, through the spec: `history` only

    states = planned_model_states(planned)
    if not planned or states is None:
        return []
    out = []
    for a in h.attempts:
        if a.held_bytes is None and a.device_peak is None:
            continue
        same = a.world_size is None or a.world_size == planned_world
        line = f"memory, attempt {a.attempt}: model states held {gb(a.held_bytes)} per rank"
        line += f" (planned {gb(states)})" if same else f" (planned for {planned_world} ranks, this attempt had {a.world_size})"
        peak = planned.get("peak")
        line += (f"; device peak {gb(a.device_peak)} (planned {gb(peak)})" if a.device_peak is not None
                 else f"; device peak not kept on this device (planned {gb(peak)})")
        out.append(line)
    return out


def container_notes(records: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """The image each attempt ran in (the attempts' environment records), one line per change."""
    out: list[str] = []
    last: tuple[Any, ...] | None = None
    for attempt in sorted(records):
        box = records[attempt].get("container")
        if not isinstance(box, dict):
            continue
        key = (box.get("runtime"), box.get("image"), box.get("image_id"))
        if key != last:
            first = "container" if last is None else "container changed"
            out.append(f"{first}, attempt {attempt}: {box.get('runtime')} image {box.get('image')} "
                       f"({box.get('image_id') or 'identity unknown'})")
            last = key
    return out


def _heartbeat_fresh(times: list[float] | None, now: float, within_s: float = 600.0) -> bool:
    return bool(times) and times is not None and now - max(times) < within_s


def _last_step_of(heartbeat: Sequence[Mapping[str, Any]], attempt: int) -> int | None:
    steps = [int(b["step"]) for b in heartbeat if b.get("attempt") == attempt and b.get("step") is not None]
    return max(steps) if steps else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def unstarted_notes(job_ids: Sequence[str], ledger: Sequence[Mapping[str, Any]],
                    errors: Mapping[str, Sequence[str]]) -> list[str]:
    """A note for each job of the run that ran without starting an attempt (its tasks failed
    before lmtrain's entry: an interpreter missing, a container that did not start): the job and
    the task's own error lines (``errors``: job id -> error lines of its task 0's srun log)."""
    started = {str(e.get("job_id")) for e in ledger if e.get("event") == "start"}
    out = []
    for job in job_ids:
        lines = [x.strip() for x in errors.get(job, ()) if x.strip()]
        if job in started or not lines:
            continue
        own = [x for x in lines if not x.startswith("srun: error:")] or lines
        out.append(f"job {job} ended before any attempt started (its tasks failed before the training entry): "
                   f"{own[0][:300]}" + (f" ({lines[-1][:120]})" if lines[-1] != own[0] else ""))
    return out

