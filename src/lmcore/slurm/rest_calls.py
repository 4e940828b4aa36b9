"""The SLURM client's calls over slurmrestd: what lmcore.slurm.client's squeue, sacct, show_job,
cancel, requeue, ping and sbatch do when a command runs through a cluster's REST API. Each
answers with the records the commands' path gives (rest_records.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from lmcore.slurm import rest_records
from lmcore.slurm.records import AccountedJob, QueuedJob
from lmcore.slurm.rest import RestClient, RestError
from lmcore.slurm.rest_job import UNSET, RestJobError, job_description


def ping(r: RestClient) -> bool:
    return r.ping()


def squeue(r: RestClient, job_ids: Iterable[str] | None, name: str | None, user: str | None) -> list[QueuedJob]:
    """As ``squeue -r [-j IDS] [-n NAME] [-u USER]``: an array's id stands for all its tasks."""
    ids = None if job_ids is None else {str(j) for j in job_ids}
    if ids is not None and not ids:
        return []
    out = []
    for q in (row for rec in r.jobs() for row in rest_records.queued_rows(rec)):
        if ids is not None and q.job_id not in ids and q.job_id.split("_")[0] not in ids:
            continue
        if name is not None and q.name != name:
            continue
        if user is not None and q.user != user:
            continue
        out.append(q)
    return out


def sacct(r: RestClient, job_ids: Sequence[str], duplicates: bool) -> list[AccountedJob]:
    rows = [rest_records.accounted(rec) for rec in r.accounted(list(job_ids), duplicates=duplicates)]
    return sorted(rows, key=lambda a: (a.submit, a.start))


def show_job(r: RestClient, job_id: str) -> dict[str, str] | None:
    recs = r.job(job_id)
    return rest_records.show_job(recs[0]) if recs else None


def cancel(r: RestClient, job_ids: Sequence[str], signal: str | None) -> None:
    for job_id in job_ids:
        r.cancel(job_id, signal)


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


def body_of(r: RestClient, text: str, what: str, extra: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The submission of script ``text`` as sbatch would make it (its #SBATCH options as the job's
    fields, then ``extra`` as sbatch's command line; this process's environment and directory),
    checked against the fields the server's job description has: a RestError naming what cannot
    be carried, before anything is submitted."""
    try:
        body = job_description(text, environment=dict(os.environ), cwd=os.getcwd(), extra=extra,
                               host=socket.gethostname().split(".")[0], nice=os.getpriority(os.PRIO_PROCESS, 0))
    except RestJobError as exc:
        raise RestError(f"{r.target.where}: {what} cannot be submitted over REST: {exc}") from None
    offered = set(r.job_fields())
    for key in UNSET:  # sbatch's "not set" for a field this server's API lacks: nothing to send
        if offered and key not in offered:
            body["job"].pop(key, None)
    r.check_fields(body)
    return body


def submit_file(r: RestClient, path: str, extra: Sequence[tuple[str, str]] = ()) -> str:
    """The script at ``path`` submitted as sbatch would submit it."""
    with open(path) as f:
        text = f.read()
    return r.submit(body_of(r, text, f"the job script {path}", extra))
