"""What `lmlaunch status` and `history` show about runs, as row models (no rendering here:
launcher/monitor/view.py draws them; no reading either: launcher/monitor/run_files.py reads the run
directories, launcher/monitor/slurm_view.py asks SLURM). Pure functions from those readings to rows,
so renderers and tests work on synthetic run directories."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher.monitor import eval_rows, status_cache
from launcher.monitor.run_files import RunFiles
from launcher.monitor.slurm_view import UNREACHABLE, SlurmJob, SlurmView, format_duration, query_slurm
from launcher.planning import transport
from launcher.runs.run_lock import watcher_alive
from lmcore.errors import UserError
from lmcore.run import straggler_lines
from lmcore.slurm import client as slurm

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
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # the ranks slow now (slow_ranks)
    spares: list[str] | None = None  # a running job with spare nodes: the idle ones (None: no spares)
    layout: list[dict[str, Any]] | None = None  # a running attempt's nodes: node, its switch/block, its ranks
    eval: dict[str, Any] | None = None  # the evaluator alongside: newest scores, state (launcher.monitor.eval_rows.summary)
    cluster: str = ""  # the cluster profile of its current job (a run over several clusters moves between them)

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
                    "preempted": "PREEMPTED", "node_failure": "NODE_FAIL", "pruned": "COMPLETED"}


def last_end_of(ledger: Sequence[Mapping[str, Any]], job_id: str) -> Mapping[str, Any] | None:
    """The end line of ``job_id``'s last attempt, when that attempt is the run's last one."""
    last = next((e for e in reversed(ledger) if e.get("event") in ("start", "end")), None)
    if last is None or last.get("event") != "end" or str(last.get("job_id")) != str(job_id):
        return None
    return last


def layout_of(ledger: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """The last attempt's nodes in rank order, each with its switch or block (the start line's, a
    plan with a placement) and its ranks (SLURM's block distribution); None before a start."""
    last = next((e for e in reversed(ledger) if e.get("event") == "start"), None)
    nodes = last.get("nodes") if last is not None else None
    if last is None or not isinstance(nodes, list) or not nodes:
        return None
    groups = last.get("groups") if isinstance(last.get("groups"), dict) else {}
    per = int(last.get("world_size") or len(nodes)) // len(nodes) or 1
    return [{"node": str(n), "group": groups.get(n), "ranks": [k * per, (k + 1) * per - 1]} for k, n in enumerate(nodes)]


def spares_of(ledger: Sequence[Mapping[str, Any]]) -> list[str] | None:
    """The idle spare nodes the run's last attempt started with (None: a job without spares)."""
    last = next((e for e in reversed(ledger) if e.get("event") == "start"), None)
    spares = last.get("spares") if last is not None else None
    return [str(n) for n in spares] if isinstance(spares, list) else None


def ended_state(end: Mapping[str, Any]) -> str:
    """The SLURM-like state of an attempt's end line: its reason, or for a limit reached
    (max_timeouts, max_preemptions, ...) the stop that reached it ("timeout: SIGUSR2 ...")."""
    reason = str(end.get("reason") or "")
    if reason == "limit_reached":
        reason = str(end.get("detail") or "").split(":", 1)[0]
    return _STATE_OF_REASON.get(reason, "FAILED")


def _abandoned_move(ledger: Sequence[Mapping[str, Any]], job_id: str | None, group: str) -> str | None:
    """The last move between clusters when it was abandoned (launcher.submit.mover: a checkpoint
    copy that failed) and ``job_id``, queued, is the one it left waiting."""
    moves = [e for e in ledger if e.get("event") in ("moved", "move_failed", "move_abandoned")]
    if group != "queued" or not moves or moves[-1].get("event") != "move_abandoned" \
            or str(moves[-1].get("from_job")) != str(job_id):
        return None
    return f"a move to {moves[-1].get('to')} was abandoned ({moves[-1].get('error')}); it waits on {moves[-1].get('from')} still"


def build_row(rec: Any, files: RunFiles, job: SlurmJob | None, *, slurm_reachable: bool, now: float) -> StatusRow:
    """Pure: registry record + run-directory readings + SLURM's view of the current job -> a row."""
    beats = files.heartbeat
    last_step = next((b for b in reversed(beats) if b.get("event") == "step"), None)
    last_any_step = next((b for b in reversed(beats) if b.get("step") is not None), None)
    max_steps = next((int(b["max_steps"]) for b in reversed(beats) if b.get("max_steps")), rec.max_steps)
    requeued = bool(job and job.attempts > 1)
    if not slurm_reachable:
        state, group, reason = UNREACHABLE, "unknown", None
        note = "DONE marker: reached max_steps" if files.done else (
            "CANCELLED marker" if files.cancelled or rec.state == "cancelled" else "")
    elif job is not None:
        state, group, reason, note = _queued_or_running(rec, files, job, requeued)
    else:
        state, group, note = _without_slurm_record(rec, files)
        reason = None
    if not files.exists:
        note = (note + "; " if note else "") + f"run directory missing: {rec.run_dir}"
    last_step, note = _what_the_run_says(rec, files, last_step, note)
    ended = last_end_of(files.ledger, rec.job_ids[-1]) if rec.job_ids else None
    if ended is not None and ended.get("reason") == "pruned" and group in ("completed", "unknown"):
        # a search's trial stopped early by its pruner: SLURM says COMPLETED, the run says why
        state, group = "PRUNED", "completed"
        note = "; ".join(x for x in (str(ended.get("detail") or "pruned").split("; checkpoint")[0], note) if x)
    if group == "failed" and rec.job_ids and not any(
            e.get("event") == "start" and str(e.get("job_id")) == str(rec.job_ids[-1]) for e in files.ledger):
        note = "; ".join(x for x in (f"job {rec.job_ids[-1]} ended before any attempt started: its tasks failed before "
                                     f"the training entry (`lmlaunch logs {rec.name} --errors` shows why)", note) if x)
    stragglers = straggler_lines.slow_ranks(files.ledger) if group == "running" else []
    if stragglers:
        note = (note + "; " if note else "") + "slow: " + ", ".join(straggler_lines.describe(s) for s in stragglers)

    note = "; ".join(x for x in (_abandoned_move(files.ledger, rec.last_job_id, group), note, _bucket_note(ended)) if x)
    if files.evaluation is not None and (said := eval_rows.note(files.evaluation, rec.name)):
        note = (note + "; " if note else "") + said
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
        name=rec.name, job_id=rec.job_ids[-1] if rec.job_ids else None, state=state, group=group, reason=reason,
        requeued=requeued, nodes=job.num_nodes if job and job.num_nodes else None,
        elapsed=job.elapsed if job and job.elapsed else None, time_limit=_normalize_limit(time_limit),
        attempt=attempt, step=step, max_steps=max_steps, loss=_num(last_step, "loss"),
        tokens_per_s=_num(last_step, "tokens_per_s"), mfu=_num(last_step, "mfu"),
        checkpoint_step=ck.step if ck else None, checkpoint_age_s=max(0.0, now - ck.mtime) if ck else None,
        eta_s=eta, heartbeat_age_s=max(0.0, now - hb_time) if hb_time else None, run_dir=rec.run_dir,
        job_ids=list(rec.job_ids), note=note, stragglers=stragglers,
        spares=spares_of(files.ledger) if group == "running" else None,
        layout=layout_of(files.ledger) if group == "running" else None,
        eval=eval_rows.summary(files.evaluation) if files.evaluation is not None else None,
        cluster=rec.profile_of(rec.job_ids[-1]) if rec.job_ids else rec.profile,
    )


def _bucket_note(ended: Mapping[str, Any] | None) -> str:
    """The last attempt's newest checkpoint that never reached the run's bucket (checkpoint.dir s3://:
    lmtrain.checkpoint.store_mirror), said until an attempt ends with it there."""
    b = (ended or {}).get("bucket")
    if not isinstance(b, dict) or b.get("uploaded", True):
        return ""
    return (f"checkpoint step-{b.get('step')} is not in {b.get('store')} ({str(b.get('error'))[:160]}): the next "
            "attempt uploads it")


def _queued_or_running(rec: Any, files: RunFiles, job: SlurmJob, requeued: bool) -> tuple[str, str, str | None, str]:
    """(state, group, pending reason, note) of a run whose job SLURM knows."""
    state, group = job.state, slurm.state_group(job.state)
    reason = job.reason if group == "queued" and job.reason and job.reason != "None" else None
    note = ""
    if requeued and group == "queued":
        note = "requeued, waiting to restart"
        if files.done:  # SLURM 24.11 requeues a job preempted once more after it ended (docs/architecture.md)
            note = "finished (DONE marker), yet requeued by SLURM: that start ends at once, training nothing"
    upstream = ", ".join(getattr(rec, "after", None) or []) or "another job"
    if group == "queued" and job.reason == "Dependency":
        note = f"waiting for {upstream}"  # submit --after's runs, or a preparation's array
    elif group == "queued" and job.reason == "DependencyNeverSatisfied":
        note = f"never starts: {upstream} did not succeed (`lmlaunch cancel {rec.name}`)"
    ended = last_end_of(files.ledger, rec.job_ids[-1]) if group == "running" and rec.job_ids else None
    if ended is not None and ended.get("restart") == "in_place":  # no attempt started since: the ranks are starting
        left_out = ",".join(ended.get("left_out") or [])
        note = (f"restarting in place: attempt {ended.get('attempt')} ended {ended.get('reason')} at step "
                f"{ended.get('end_step')}, its ranks start again in the same allocation"
                + (f" without {left_out}" if left_out else ""))
    elif group == "running" and (spares := spares_of(files.ledger)) is not None:
        note = f"spare node(s) idle: {','.join(spares)}" if spares else "no spare node left"
        if not watcher_alive(rec.run_dir):  # submit starts it; a login node's restart ends it
            note += (f"; its watcher is not running (`lmlaunch move {rec.name} --detach`): nobody outside the job "
                     "requeues it if its batch script's node fails")
    if files.cancelled and group in ("queued", "running"):
        note = "cancel requested"
    return state, group, reason, note


def _without_slurm_record(rec: Any, files: RunFiles) -> tuple[str, str, str]:
    """(state, group, note) of a run SLURM no longer (or never) knew: from its markers and ledger."""
    if files.done:
        return "COMPLETED", "completed", "DONE marker (SLURM has no record of the job)"
    if files.cancelled or rec.state == "cancelled":
        return "CANCELLED", "cancelled", "CANCELLED marker (SLURM has no record of the job)"
    if rec.job_ids and (ended := last_end_of(files.ledger, rec.job_ids[-1])) is not None:
        note = (f"attempt {ended.get('attempt')} ended {ended.get('reason')}, "
                + ("asked to be requeued, but SLURM has no record of the job" if ended.get("requeued")
                   else "not requeued (run directory; SLURM has no record of the job)"))
        state = "UNKNOWN" if ended.get("requeued") else ended_state(ended)
        return state, slurm.state_group(state), note
    if rec.job_ids:
        return "UNKNOWN", "unknown", "neither squeue nor sacct knows the job"
    return "NOT SUBMITTED", "unknown", ""


def _what_the_run_says(rec: Any, files: RunFiles, last_step: Mapping[str, Any] | None,
                       note: str) -> tuple[Mapping[str, Any] | None, str]:
    """An eval run's result (its loss in place of a step's), a failed task, a preparation's
    progress: the row's loss source and its note, with these said first."""
    beats = files.heartbeat
    ev = next((e for e in reversed(files.ledger) if e.get("event") == "eval"), None)  # an eval run's result
    if ev is not None:
        last_step, note = {"loss": ev.get("val_loss")}, "; ".join(x for x in (
            f"eval of step-{ev.get('step')}: val_loss {_num(ev, 'val_loss') or 0:.4f}, perplexity "
            f"{_num(ev, 'perplexity') or 0:.2f}", note) if x)
    failed = next((b for b in reversed(beats) if b.get("event") == "end" and b.get("error")
                   and str(b.get("job_id")) in rec.job_ids), None)  # this submission's, not one before it
    if failed is not None:  # a preparation task that met a bad input
        who = f"task {failed['task']}" if failed.get("task") is not None else "the job"
        note = "; ".join(x for x in (f"{who} failed: {failed['error']}", note) if x)
    prep = preparation_line(beats)
    if prep is not None:  # a data preparation on the cluster: its shards are the steps
        so_far = "in the store" if prep.get("event") == "end" else "tokenized so far"
        note = "; ".join(x for x in (f"{int(prep['documents']):,} documents, {int(prep.get('tokens') or 0):,} tokens "
                                     f"{so_far}", note) if x)
    return last_step, note


def preparation_line(heartbeat: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """A `data prepare --on-cluster` run's newest heartbeat line with figures (documents, tokens;
    lmtrain.data.prepare.array_task); None for a training run."""
    return next((b for b in reversed(heartbeat) if isinstance(b.get("documents"), int)), None)


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
    files have not changed since the last call is not read again (launcher/monitor/status_cache.py)."""
    rows, view, _files = gather_status_and_files(records, environ=environ, now=now)
    return rows, view


def gather_status_and_files(
    records: Sequence[Any],
    *,
    environ: Mapping[str, str] | None = None,
    now: float | None = None,
) -> tuple[list[StatusRow], SlurmView, list[RunFiles]]:
    """:func:`gather_status`, and what each run directory said (the exporter counts the ledger)."""
    import contextvars
    import threading

    now = time.time() if now is None else now
    groups = transport.by_cluster(records, environ)  # runs on clusters of their own: each asked there
    views: list[SlurmView] = []
    asked = contextvars.copy_context()  # the cluster this command asks (--rest, a run's own) goes along
    t = threading.Thread(target=lambda: asked.run(lambda: views.extend(_ask_each_cluster(records, groups, environ))))
    t.start()
    files = status_cache.read_all([r.run_dir for r in records], environ)
    t.join()
    rows: list[StatusRow | None] = [None] * len(records)
    for (_, indices), view in zip(groups, views):
        for i in indices:
            r = records[i]
            rows[i] = build_row(r, files[i], view.jobs.get(r.last_job_id or ""), slurm_reachable=view.reachable, now=now)
    return [r for r in rows if r is not None], _merged(views), files


def _ask_each_cluster(records: Sequence[Any], groups: list[tuple[Any, list[int]]],
                      environ: Mapping[str, str] | None) -> list[SlurmView]:
    """Each cluster's view of its runs' current jobs (one squeue, at most one sacct, each)."""
    views = []
    for target, indices in groups:
        ids = [records[i].last_job_id for i in indices if records[i].last_job_id]
        scope = getattr(target, "profile", "") if target is not None else ""
        try:
            with transport.through(target):
                views.append(query_slurm(ids, environ=environ, scope=scope))
        except UserError as exc:  # its profile's slurm_conf or slurm_bin gone
            views.append(SlurmView(jobs={}, reachable=False, message=exc.message))
    return views


def _merged(views: list[SlurmView]) -> SlurmView:
    """One view for the table's footer and --json: reachable when every cluster answered."""
    if len(views) == 1:
        return views[0]
    jobs = {}
    for v in views:
        jobs.update(v.jobs)
    return SlurmView(jobs=jobs, reachable=all(v.reachable for v in views),
                     message="; ".join(v.message for v in views if v.message),
                     calls=[c for v in views for c in v.calls])
