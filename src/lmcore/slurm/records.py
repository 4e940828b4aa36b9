"""SLURM's job states in lmlaunch's few words, and the job records both transports give
(squeue's and sacct's rows; lmcore.slurm.client fills them from the commands, rest_records.py
from slurmrestd's answers)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcore.slurm import versions

# SLURM job states -> the few states lmlaunch talks about (one table, like torchx).
STATE_GROUPS: dict[str, str] = {
    "PENDING": "queued",
    "CONFIGURING": "queued",
    "REQUEUED": "queued",
    "REQUEUE_HOLD": "queued",
    "REQUEUE_FED": "queued",
    "RESV_DEL_HOLD": "queued",
    "SUSPENDED": "queued",
    "RUNNING": "running",
    "COMPLETING": "running",
    "SIGNALING": "running",
    "STAGE_OUT": "running",
    "RESIZING": "running",
    "STOPPED": "running",
    "PREEMPTED": "preempted",
    "COMPLETED": "completed",
    "CANCELLED": "cancelled",
    "FAILED": "failed",
    "NODE_FAIL": "failed",
    "BOOT_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "DEADLINE": "failed",
    "TIMEOUT": "timeout",
    **versions.job_states(),  # the states a release added (26.05's EXPEDITING: lmcore.slurm.versions)
}
ACTIVE_GROUPS = frozenset({"queued", "running"})


def het_leader(job_id: str) -> str:
    """sacct's name of a heterogeneous job's first component (``J+0``, its steps ``J+0.S``) is the job's
    own id as sbatch returned it (``J``, ``J.S``); other components keep theirs (``J+1``): the
    evaluator alongside the training (lmcore.run.eval_alongside)."""
    head, plus, rest = job_id.partition("+")
    if not plus:
        return job_id
    offset, dot, step = rest.partition(".")
    return head + dot + step if offset == "0" else job_id


def het_component(job_id: str, het_job_id: str, offset: str) -> str:
    """squeue's row of a heterogeneous job's component (each has its own JobID) named as sacct
    names it: the first component by the job's id, the others ``J+N``; other jobs unchanged."""
    if not (het_job_id.isdigit() and offset.isdigit()) or offset == "0":
        return job_id
    return f"{het_job_id}+{offset}"


def state_word(state: str | None) -> str:
    """SLURM's state as one word: 'CANCELLED by 0' -> 'CANCELLED', 'COMPLETING+' -> 'COMPLETING';
    '' when there is none. Every reader of a state from squeue, sacct or scontrol uses it."""
    return state.split()[0].rstrip("+").upper() if state and state.strip() else ""


def state_group(state: str) -> str:
    """'CANCELLED by 0' -> 'cancelled'; unknown states -> 'unknown'."""
    return STATE_GROUPS.get(state_word(state), "unknown")


def is_active(state: str) -> bool:
    """Queued or running (the job may still use resources or start)."""
    return state_group(state) in ACTIVE_GROUPS


class _InStateGroup:
    """A job record's ``group``: lmlaunch's word for its SLURM state (:data:`STATE_GROUPS`)."""

    state: str

    @property
    def group(self) -> str:
        return state_group(self.state)


@dataclass(frozen=True)
class AccountedJob(_InStateGroup):
    job_id: str
    name: str
    state: str  # e.g. COMPLETED, CANCELLED by 0, PREEMPTED, REQUEUED
    exit_code: str
    start: str
    end: str
    elapsed: str
    nodes: str
    partition: str
    submit: str
    alloc_tres: str = ""  # sacct's AllocTRES: cpu=8,gres/gpu=8,node=2 (gres/gpu only where accounting tracks it)

    @property
    def gpus(self) -> int | None:
        """The GPUs the attempt held (AllocTRES gres/gpu), None when accounting says nothing of GPUs."""
        return gpus_in_tres(self.alloc_tres)


def gpus_in_tres(text: str) -> int | None:
    """``gres/gpu=N`` of a TRES list (``cpu=8,gres/gpu:h100=8,gres/gpu=8``), None without one."""
    for item in text.split(","):
        name, _, count = item.partition("=")
        if name.strip() == "gres/gpu" and count.strip().isdigit():
            return int(count)
    return None


@dataclass(frozen=True)
class QueuedJob(_InStateGroup):
    """One job as the controller knows it now (squeue: queued, running, or ended within MinJobAge)."""

    job_id: str
    name: str
    state: str  # SLURM state, upper case: PENDING, RUNNING, ...
    reason: str  # PENDING: Priority, Resources, BeginTime, Dependency ...; 'None' otherwise
    restarts: int  # SLURM_RESTART_COUNT of the current attempt (requeues so far)
    time_limit: str
    num_nodes: int
    elapsed: str
    nodelist: str
    partition: str
    user: str
    start: str
    submit: str
