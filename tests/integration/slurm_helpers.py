"""Helpers shared by the integration tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

from launcher import slurm

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"completed", "cancelled", "failed", "timeout", "preempted"}


def wait_terminal(job_id: str, timeout: float) -> str:
    """Wait for one of our jobs to end (requeued attempts are started at once)."""
    return slurm.wait_for(job_id, TERMINAL, timeout=timeout, poll=1.0, start_requeued=True)


def wait_accounted(job_id: str, timeout: float = 30.0) -> slurm.AccountedJob:
    """sacct lags the controller by a moment: wait until accounting has the final state."""
    deadline = time.monotonic() + timeout
    while True:
        rows = slurm.sacct([job_id])
        if rows and rows[-1].group in TERMINAL:
            return rows[-1]
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct has no final state for job {job_id}: {rows}")
        time.sleep(1.0)
