"""A task's first act: record where it runs and its pid (launcher.core.task_records), so that
``lmlaunch stacks RUN`` can ask py-spy for its live stack while the job runs."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

from launcher.core.task_records import TaskRecord, write_task_record
from lmtrain.env import read_env

log = logging.getLogger(__name__)


def record_this_task(run_dir: str | Path) -> None:
    """Write this process's record; a failure costs only ``lmlaunch stacks``, never the task."""
    try:
        env = read_env()
        write_task_record(run_dir, TaskRecord(
            rank=env.rank, local_rank=env.local_rank, node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            pid=os.getpid(), job_id=env.job_id, restart_count=env.restart_count, python=sys.executable,
            time=time.time(),
        ))
    except Exception as exc:  # any failure here costs only the stacks command
        log.warning("could not record this task for `lmlaunch stacks`: %s", exc)
