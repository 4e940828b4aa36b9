"""What SLURM says about the runs' jobs, for `status` and `history`: ONE ``squeue`` call for the
current job of every run and at most ONE ``sacct`` call (only for the jobs the controller has
forgotten, whose answers are cached for good). Never raises for an unreachable SLURM: the view
says so instead."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hostlist

from launcher.runs.registry import lmlaunch_home
from lmcore.atomic import write_private
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.slurm import client as slurm

CACHE_FILE = "cache/final-jobs.json"  # under $LMLAUNCH_HOME: sacct rows of jobs that can no longer change
UNREACHABLE = "unknown (SLURM unreachable)"
SLURM_TIMEOUT_S = 10.0  # status waits this long for a busy controller, then shows the run dirs alone


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
    return lmlaunch_home(environ) / CACHE_FILE


def _load_cache(environ: Mapping[str, str] | None) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_cache_path(environ).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def final_job_ids(environ: Mapping[str, str] | None = None) -> set[str]:
    """Jobs known to have ended for good (the controller forgot them; accounting said how)."""
    return set(_load_cache(environ))


class EndedJobs:
    """Jobs known to have ended: accounting's cached final states, and (``queued`` given: what the
    controller has now) every job it no longer lists as pending or running. A test of membership."""

    def __init__(self, final: set[str], queued: set[str] | None) -> None:
        self.final, self.queued = final, queued

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.final or (self.queued is not None and job_id not in self.queued)


def ended_jobs(environ: Mapping[str, str] | None = None) -> EndedJobs:
    """What plain `status` may skip unread: one squeue of the user's pending and running jobs
    (milliseconds), whatever accounting holds; SLURM unreachable: the cached final states only."""
    import getpass

    try:
        queued = {q.job_id for q in slurm.squeue(user=getpass.getuser(), timeout=SLURM_TIMEOUT_S)}
    except (SlurmUnavailable, UserError, KeyError, OSError):
        queued = None
    return EndedJobs(final_job_ids(environ), queued)


def _save_cache(cache: dict[str, dict[str, Any]], environ: Mapping[str, str] | None) -> None:
    path = _cache_path(environ)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, json.dumps(cache, sort_keys=True))
    except OSError:
        pass  # a cache that cannot be written only costs the next status one sacct call


def query_slurm(job_ids: Iterable[str], *, environ: Mapping[str, str] | None = None, cache: bool = True,
                scope: str = "") -> SlurmView:
    """ONE squeue call for all ``job_ids``; ONE sacct call for those squeue no longer knows.

    A job the controller has forgotten is finished for good, so its sacct answer is cached
    (``$LMLAUNCH_HOME/cache/final-jobs.json``) and later calls skip sacct for it.
    Never raises for an unreachable SLURM: the view says so instead. ``scope``: the profile of a
    cluster of its own (its job ids are other jobs than this cluster's), keying its cached answers.
    """
    ids = sorted({str(j) for j in job_ids if j}, key=_job_sort_key)
    view = SlurmView(jobs={})
    if not ids:
        return view
    try:
        view.calls.append("squeue")
        for q in slurm.squeue(ids, timeout=SLURM_TIMEOUT_S):
            view.jobs[q.job_id] = SlurmJob(q.job_id, q.state, q.reason, q.restarts + 1, q.time_limit,
                                           q.num_nodes, q.elapsed, q.nodelist, "squeue")
    except (SlurmUnavailable, UserError) as exc:
        view.reachable = False
        view.message = exc.message
        return view
    cached = _load_cache(environ) if cache else {}

    def key(j: str) -> str:
        return f"{scope}:{j}" if scope else j

    missing = [j for j in ids if j not in view.jobs and key(j) not in cached]
    for j in ids:
        if j not in view.jobs and key(j) in cached:
            view.jobs[j] = SlurmJob(**{**cached[key(j)], "source": "cache"})
    if missing:
        try:
            view.calls.append("sacct")
            rows = slurm.sacct(missing, duplicates=True, timeout=SLURM_TIMEOUT_S)
        except slurm.NoAccounting as exc:
            view.message = f"note: {exc.message}"
            rows = []
        except (SlurmUnavailable, UserError) as exc:
            view.message = f"accounting: {exc.message}"
            rows = []
        by_job: dict[str, list[Any]] = {}
        for r in rows:
            by_job.setdefault(r.job_id, []).append(r)
        for jid, attempts in by_job.items():
            last = attempts[-1]
            job = SlurmJob(jid, slurm.state_word(last.state), "", len(attempts), "", _count_nodes(last.nodes),
                           _elapsed(last.elapsed), last.nodes, "sacct")
            view.jobs[jid] = job
            if cache and not slurm.is_active(last.state):
                cached[key(jid)] = {k: v for k, v in asdict(job).items() if k != "source"}
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


def _elapsed(text: str) -> str:
    """sacct's 00:00:33 -> squeue's 0:33 (one format in the table)."""
    secs = slurm.parse_duration(text)
    return text if secs is None else format_duration(secs, slurm_style=True)


def sacct_attempt_times(job_ids: Sequence[str]) -> tuple[dict[str, list[tuple[Any, ...]]], str]:
    """ONE `sacct -D` call: (submit, start, end, GPUs held) of every attempt of every job, in order
    (GPUs from AllocTRES: None where accounting tracks none). Returns the map and a message (''
    when accounting answered)."""
    try:
        rows = slurm.sacct(list(job_ids), duplicates=True)
    except (SlurmUnavailable, UserError) as exc:
        return {}, exc.message
    out: dict[str, list[tuple[Any, ...]]] = {}
    for r in rows:
        out.setdefault(r.job_id, []).append(
            (slurm.parse_time(r.submit), slurm.parse_time(r.start), slurm.parse_time(r.end), r.gpus))
    return out, ""


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
