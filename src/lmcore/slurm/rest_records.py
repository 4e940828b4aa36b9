"""slurmrestd's job records as the records the command-line path gives (pure; no I/O).

squeue's and sacct's rows are text (times as local ``YYYY-MM-DDTHH:MM:SS``, durations as
``[D-]H:MM:SS``, limits as squeue prints them); the REST answers are numbers in ``{set, infinite,
number}`` wrappers. Everything downstream (status, history, cancel, the preemption policy's
facts) reads the text forms, so the REST path writes exactly those.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from lmcore.slurm.records import AccountedJob, QueuedJob, het_component


def number(value: Any, default: int | None = None) -> int | None:
    """A ``{set, infinite, number}`` wrapper's number (None: unset or infinite), or a plain number."""
    if isinstance(value, Mapping):
        if not value.get("set", False) or value.get("infinite", False):
            return default
        value = value.get("number")
    return int(value) if isinstance(value, (int, float)) else default


def stamp(epoch: int | None) -> str:
    """A time as squeue and sacct print it (local time), or what they print for none."""
    if not epoch:
        return "N/A"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch))


def duration(seconds: int | None) -> str:
    """[D-]H:MM:SS, as squeue's TimeUsed and sacct's Elapsed (M:SS under an hour, as squeue)."""
    if seconds is None:
        return "INVALID"
    s = max(0, int(seconds))
    days, rest = divmod(s, 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    if days:
        return f"{days}-{h:02d}:{m:02d}:{sec:02d}"
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def limit(minutes: Any) -> str:
    if isinstance(minutes, Mapping) and minutes.get("infinite"):
        return "UNLIMITED"
    n = number(minutes)
    return "UNLIMITED" if n is None else duration(n * 60)


def _job_id(rec: Mapping[str, Any]) -> str:
    task = number(rec.get("array_task_id"))
    array = number(rec.get("array_job_id"))
    if task is not None and array:
        return f"{array}_{task}"
    het, offset = number(rec.get("het_job_id")), number(rec.get("het_job_offset"))
    return het_component(str(rec.get("job_id")), str(het or ""), str(offset if offset is not None else ""))


# The state flags that squeue's %T and scontrol's JobState print instead of the base state, in the
# order SLURM's job_state_string() tests them (a job COMPLETING its cancellation reads COMPLETING).
STATE_FLAGS = ("COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT",
               "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT", "EXPEDITING")


def _state(states: Any) -> str:
    """The state as squeue and scontrol print it: a flag of :data:`STATE_FLAGS` the list holds,
    else its base state (REST lists ``[CANCELLED, COMPLETING]`` where squeue says COMPLETING)."""
    if not isinstance(states, list):
        return str(states or "UNKNOWN")
    words = [str(w) for w in states]
    return next((f for f in STATE_FLAGS if f in words), words[0] if words else "UNKNOWN")


def array_tasks(rec: Mapping[str, Any]) -> list[int]:
    """The pending tasks a job array's one record stands for (its ``array_task_string``, e.g.
    ``0-3%2`` or ``1,4-5``), as ``squeue -r`` lists them one per line; [] for any other record."""
    text = str(rec.get("array_task_string", "") or "")
    if not text or number(rec.get("array_task_id")) is not None:
        return []
    tasks: list[int] = []
    for part in text.split("%")[0].split(","):
        lo, _, rest = part.partition("-")
        hi, _, step = rest.partition(":")
        if lo.isdigit():
            tasks += list(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    return tasks


def queued_rows(rec: Mapping[str, Any], now: float | None = None) -> list[QueuedJob]:
    """One record of ``GET /slurm/<v>/jobs`` as squeue -r's rows: a pending array's one row per task."""
    row = queued(rec, now)
    tasks = array_tasks(rec)
    if not tasks:
        return [row]
    import dataclasses

    return [dataclasses.replace(row, job_id=f"{rec.get('job_id')}_{t}") for t in tasks]


def queued(rec: Mapping[str, Any], now: float | None = None) -> QueuedJob:
    """A job of ``GET /slurm/<v>/jobs`` as squeue's row."""
    now = time.time() if now is None else now
    state = _state(rec.get("job_state"))
    start, end = number(rec.get("start_time")), number(rec.get("end_time"))
    before = number(rec.get("pre_sus_time"), 0) or 0  # run time before the last suspension
    resumed = max(start or 0, number(rec.get("suspend_time"), 0) or 0)  # when it last started or resumed
    if state == "SUSPENDED":
        used: int | None = before
    elif state in ("RUNNING", "COMPLETING") and start:
        used = before + int(now) - resumed
    elif start and end and end >= start and state != "PENDING":
        used = end - start
    else:
        used = 0
    nodes = number(rec.get("node_count"), 0) or 0
    return QueuedJob(
        _job_id(rec), str(rec.get("name", "")), state, str(rec.get("state_reason", "None")),
        int(rec.get("restart_cnt", 0) or 0), limit(rec.get("time_limit")), nodes, duration(used),
        str(rec.get("nodes", "") or ""), str(rec.get("partition", "")), str(rec.get("user_name", "")),
        stamp(start) if state != "PENDING" else "N/A", stamp(number(rec.get("submit_time"))))


def accounted(rec: Mapping[str, Any]) -> AccountedJob:
    """A job of ``GET /slurmdb/<v>/jobs`` as sacct's row (JobID..Submit)."""
    t = rec.get("time", {}) or {}
    state = rec.get("state", {}) or {}
    words = state.get("current", []) if isinstance(state, Mapping) else state
    st = _state(words)
    if st == "CANCELLED" and rec.get("kill_request_user"):
        st = f"CANCELLED by {rec['kill_request_user']}"
    code = rec.get("exit_code", {}) or {}
    rc = number(code.get("return_code"), 0) or 0
    sig = number((code.get("signal") or {}).get("id"), 0) or 0
    array = rec.get("array", {}) or {}
    task = number(array.get("task_id"))
    het = rec.get("het", {}) or {}
    offset, het_id = number(het.get("job_offset")), number(het.get("job_id"))
    jid = f"{array.get('job_id')}_{task}" if task is not None and array.get("job_id") else \
        het_component(str(rec.get("job_id")), str(het_id or ""), str(offset if offset is not None else ""))
    start, end = number(t.get("start")), number(t.get("end"))
    return AccountedJob(jid, str(rec.get("name", "")), st, f"{rc}:{sig}", stamp(start) if start else "Unknown",
                        stamp(end) if end else "Unknown", duration(number(t.get("elapsed"), 0)),
                        str(rec.get("nodes", "") or "None assigned"), str(rec.get("partition", "")),
                        stamp(number(t.get("submission"))), _tres_text((rec.get("tres") or {}).get("allocated")))


def _tres_text(items: Any) -> str:
    """slurmdbd's TRES list ([{type: gres, name: gpu, count: 8}, ...]) as sacct prints AllocTRES."""
    out = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, Mapping) and item.get("type") and number(item.get("count")) is not None:
            name = f"{item['type']}/{item['name']}" if item.get("name") else str(item["type"])
            out.append(f"{name}={number(item.get('count'))}")
    return ",".join(out)


def show_job(rec: Mapping[str, Any]) -> dict[str, str]:
    """A job of ``GET /slurm/<v>/job/{id}`` as ``scontrol show job``'s keys that lmlaunch reads."""
    q = queued(rec)
    exc = rec.get("excluded_nodes", "")
    return {
        "JobId": str(rec.get("job_id")), "JobName": q.name, "JobState": q.state, "Reason": q.reason,
        "Restarts": str(q.restarts), "NodeList": q.nodelist or "(null)", "NumNodes": str(q.num_nodes),
        "Partition": q.partition, "TimeLimit": q.time_limit, "StartTime": q.start, "SubmitTime": q.submit,
        "ExcNodeList": (",".join(exc) if isinstance(exc, list) else str(exc)) or "(null)",
        "Requeue": "1" if rec.get("requeue") else "0", "BatchHost": str(rec.get("batch_host", "") or ""),
        "UserId": f"{rec.get('user_name', '')}({rec.get('user_id', '')})",
        **({"ExpeditedRequeue": "Yes"} if "EXPEDITED_REQUEUE" in (rec.get("flags") or []) else {}),
    }
