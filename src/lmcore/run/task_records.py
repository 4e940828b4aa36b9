"""Where each task of a job runs: its rank, node and process id (read by ``lmlaunch stacks``).

Every task writes its record as its first act (``lmtrain.distributed.task_env.record_this_task``, before the frameworks
are imported), so a task stuck in its imports or its rendezvous is found too. The records are
keyed by what SLURM says about the process, its job id and restart count
(``logs/tasks/<job_id>-<restart_count>/node-<N>.jsonl``, :data:`lmcore.run.rundir.TASK_RECORD`),
not by the attempt number, which rank 0 picks only at the rendezvous: the CLI asks squeue for
the running job's restart count and so reads the records of the processes alive now, never
those of an earlier attempt of the same job.

One file per node, not per task (docs/scale.md: files created per attempt): each task appends its
record as one line in one ``O_APPEND`` write. A training process forked again by a restart in
place appends a newer line for its rank; the newest is the one read. Runs written before keep a
file per rank (``rank-<R>.json``), read as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmcore.jsonlines import append_jsonl
from lmcore.run.rundir import TASK_RECORD, TASK_RECORD_OF_A_RANK, RunLayout

_JOB_ID = re.compile(r"[A-Za-z0-9_.+-]{1,64}")  # SLURM's 123, 123_4 (arrays); local-<ppid>


@dataclass(frozen=True)
class TaskRecord:
    """One task process, as it recorded itself."""

    rank: int
    local_rank: int
    node: str  # SLURMD_NODENAME (the name srun --nodelist takes), else the host name
    pid: int
    job_id: str
    restart_count: int
    python: str  # the task's sys.executable: py-spy is looked for beside it
    time: float
    group: str | None = None  # the node's leaf switch or block (the plan's placement groups); None: no topology
    stage: int | None = None  # this rank's pipeline stage in the mesh (data, pipeline, tensor)
    replica: int | None = None  # this rank's data-parallel index
    gpus: str | None = None  # the GPUs it sees (CUDA_VISIBLE_DEVICES, else SLURM_STEP_GPUS; lmtrain.distributed.gpu_binding); None: a CPU job
    gpu: str | None = None  # the one it uses (its node's index, as SLURM numbers them); None: none it can tell
    rank_env: dict[str, str] | None = None  # the variables it set for itself (the plan's rank_env: NCCL_IB_HCA by its GPU)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> TaskRecord:
        """A record read back; ValueError naming what is missing or of the wrong type."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a task record is a JSON object, not {type(d).__name__}")
        types: dict[str, tuple[type, ...]] = {
            "rank": (int,), "local_rank": (int,), "node": (str,), "pid": (int,), "job_id": (str,),
            "restart_count": (int,), "python": (str,), "time": (int, float),
        }
        bad = [k for k, t in types.items() if not isinstance(d.get(k), t) or isinstance(d.get(k), bool)]
        if bad:
            raise ValueError(f"task record without a valid {', '.join(bad)}")
        if d["pid"] <= 0 or d["rank"] < 0 or not d["node"]:
            raise ValueError(f"task record with pid {d['pid']}, rank {d['rank']}, node {d['node']!r}")
        extra = {k: d[k] for k in ("group", "stage", "replica", "gpus", "gpu") if d.get(k) is not None}
        texts = ("group", "gpus", "gpu")
        if not all(isinstance(v, str) for k, v in extra.items() if k in texts) or not all(
                isinstance(v, int) and not isinstance(v, bool) for k, v in extra.items() if k not in texts):
            raise ValueError(f"task record with group/stage/replica/gpus/gpu of the wrong type: {extra}")
        own = d.get("rank_env")
        if own is not None and not (isinstance(own, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                                     for k, v in own.items())):
            raise ValueError(f"task record with a rank_env that is not names and values: {own!r}")
        return cls(**{k: d[k] for k in types}, **extra, rank_env=dict(own) if own else None)


def task_record_path(run_dir: str | Path, job_id: str, restart_count: int, node: int) -> Path:
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r} is not one SLURM gives")
    return RunLayout.of(run_dir).task_record(job_id, restart_count, node)


def write_task_record(run_dir: str | Path, record: TaskRecord, *, node: int = 0) -> Path:
    """Append ``record`` to its node's file (``node``: SLURM's node index in the step) as one line in
    one write: a reader never sees half of it, and the node's tasks never interleave."""
    path = task_record_path(run_dir, record.job_id, record.restart_count, node)
    append_jsonl(path, record.to_json())
    return path


def read_task_records(run_dir: str | Path, job_id: str, restart_count: int) -> tuple[list[TaskRecord], list[str]]:
    """The records of one start of ``job_id``, by rank (a rank's newest), and a problem line for each
    line or file that could not be read (a record is never skipped silently)."""
    folder = task_record_path(run_dir, job_id, restart_count, 0).parent
    records: dict[int, TaskRecord] = {}
    problems: list[str] = []

    def take(where: str, raw: Any) -> None:
        try:
            rec = TaskRecord.from_json(raw)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            return
        if rec.rank not in records or rec.time >= records[rec.rank].time:
            records[rec.rank] = rec

    for path in sorted(folder.glob(TASK_RECORD_OF_A_RANK.format(rank="*"))):  # a run of before
        try:
            take(str(path), json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: {exc}")
    for path in sorted(folder.glob(Path(TASK_RECORD).name.format(node="*"))):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError as exc:
            problems.append(f"{path}: {exc}")
            continue
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    take(f"{path}:{n}", json.loads(line))
                except ValueError as exc:  # a torn line: its task was killed in its write
                    problems.append(f"{path}:{n}: {exc}")
    return [records[r] for r in sorted(records)], problems


def recorded_starts(run_dir: str | Path) -> list[tuple[str, int]]:
    """(job id, restart count) of every start that left task records, newest file first."""
    root = RunLayout.of(run_dir).task_records
    found: list[tuple[float, str, int]] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for d in entries:
        job_id, sep, restarts = d.name.rpartition("-")
        if sep and restarts.isdigit() and _JOB_ID.fullmatch(job_id):
            try:
                found.append((d.stat().st_mtime, job_id, int(restarts)))
            except OSError:
                continue
    return [(j, r) for _, j, r in sorted(found, reverse=True)]


__all__ = ["TaskRecord", "read_task_records", "recorded_starts", "task_record_path", "write_task_record"]
