"""The SLURM client's calls over slurmrestd: what lmcore.slurm.client's squeue, sacct, show_job,
cancel, requeue, ping and sbatch do when a command runs through a cluster's REST API. Each
answers with the records the commands' path gives (rest_records.py)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

from lmcore.slurm import rest_records
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.records import AccountedJob, QueuedJob, is_active
from lmcore.slurm.rest import RestClient, RestError, RestUnanswered
from lmcore.slurm.rest_job import UNSET, RestJobError, job_description


def ping(r: RestClient) -> bool:
    return r.ping()


def squeue(r: RestClient, job_ids: Iterable[str] | None, name: str | None, user: str | None) -> list[QueuedJob]:
    """As ``squeue -r [--states=all -j IDS] [-n NAME] [-u USER]``: an array's id stands for all its
    tasks, a task's own job id for that task; without ids only the active jobs, as squeue's default.
    ``user`` (this login's name, to the commands) is the token's user here: the jobs are theirs."""
    ids = None if job_ids is None else {str(j) for j in job_ids}
    if ids is not None and not ids:
        return []
    owner = r.user() if user is not None else None
    out = []
    for rec in r.jobs():
        for q in rest_records.queued_rows(rec):
            if ids is not None and not ({q.job_id, q.job_id.split("_")[0], str(rec.get("job_id"))} & ids):
                continue
            if ids is None and not is_active(q.state):
                continue
            if (name is not None and q.name != name) or (owner is not None and q.user != owner):
                continue
            out.append(q)
    return out


def submitted_since(r: RestClient, name: str, since: float) -> list[str]:
    """Ids of the token user's jobs called ``name`` received at or after ``since`` (a second of
    slack), oldest first: a submission whose answer never came may have been queued all the same."""
    found = []
    for rec in r.jobs():
        submitted = rest_records.number(rec.get("submit_time"))
        offset = rest_records.number(rec.get("het_job_offset"))  # another component of a heterogeneous job: not it
        if rec.get("name") == name and rec.get("user_name") == r.user() and submitted is not None \
                and submitted >= int(since) - 1 and not offset:
            found.append((submitted, str(rec.get("job_id"))))
    return [jid for _, jid in sorted(found)]


def sacct(r: RestClient, job_ids: Sequence[str], duplicates: bool) -> list[AccountedJob]:
    rows = [rest_records.accounted(rec) for rec in r.accounted(list(job_ids), duplicates=duplicates)]
    return sorted(rows, key=lambda a: (a.submit, a.start))


def show_job(r: RestClient, job_id: str) -> dict[str, str] | None:
    recs = r.job(job_id)
    return rest_records.show_job(recs[0]) if recs else None


def cancel(r: RestClient, job_ids: Sequence[str], signal: str | None) -> None:
    """Every job asked, as scancel does (one that ended already is no error); then what failed."""
    failed = []
    for job_id in job_ids:
        try:
            r.cancel(job_id, signal)
        except RestUnanswered:
            raise
        except RestError as exc:
            if not any(m in exc.message for m in ("already completing or completed", "Invalid job id",
                                                  "Job/step already completing")):
                failed.append(f"{job_id}: {exc.message}")
    if failed:
        raise RestError("; ".join(failed))


def config(r: RestClient) -> dict[str, str]:
    """slurm.conf's settings as the controller runs them (``GET /slurm/v0.0.45/conf``, 26.05 on);
    SlurmUnavailable where the server's API has no such endpoint."""
    answer = r.conf()
    out = {}
    for key, value in answer.items():
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, dict):
            value = rest_records.number(value, None) if "number" in value else ""
        out[key] = "" if value is None else str(value)
    return out


def body_of(r: RestClient, job: BatchJob, what: str, extra: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The submission of the rendered ``job`` as sbatch would make it (the options it was rendered
    with as the job's fields, then ``extra`` as sbatch's command line; this process's environment
    and directory), checked against the fields the server's job description has: a RestError
    naming what cannot be carried, before anything is submitted."""
    try:
        body = job_description(job, environment=dict(os.environ), cwd=os.getcwd(), extra=extra,
                               host=socket.gethostname().split(".")[0], nice=os.getpriority(os.PRIO_PROCESS, 0))
    except RestJobError as exc:
        raise RestError(f"{r.target.where}: {what} cannot be submitted over REST: {exc}") from None
    offered = set(r.job_fields())
    for key in UNSET:  # sbatch's "not set" for a field this server's API lacks: nothing to send
        if offered and key not in offered:
            body["job"].pop(key, None)
    r.check_fields(body)
    return body


def submit_job(r: RestClient, job: BatchJob, what: str, extra: Sequence[tuple[str, str]] = ()) -> str:
    """The rendered ``job`` submitted as sbatch would submit it (``what`` names it in a refusal)."""
    body = body_of(r, job, what, extra)
    started = time.time()
    try:
        return r.submit(body)
    except RestUnanswered as exc:
        if not exc.sent:
            raise
        name = str(body["job"].get("name", ""))
        try:  # the request went out: the controller may have queued it and the answer got lost
            found = submitted_since(r, name, started) if name else []
        except RestError:
            found = []
        if len(found) == 1:
            return found[0]
        raise RestError(f"{exc.message}; the job may have been queued all the same: look for jobs named "
                        f"'{name}' submitted since {time.strftime('%H:%M:%S', time.localtime(started))} "
                        f"before submitting again") from None
