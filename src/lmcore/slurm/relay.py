"""SLURM's commands for ranks that run in a container without them: the batch step, on the host,
runs them on the ranks' behalf.

The ranks of a container job (lmcore.job.container) decide everything themselves, as on the
host: whether SLURM is already requeueing the job, whether to requeue it, which nodes to keep it
off. What they cannot do inside an image without SLURM's client (and its munge socket) is run
``scontrol``, ``sacct``, ``sinfo``, ``squeue`` or ``scancel``. The batch script (its lines: launcher.submit.script) starts the relay
(``slurm_relay.sh`` beside this module, run from the run's code snapshot; plain bash: the host needs no Python) in the background before ``srun``; a
rank's :func:`lmcore.slurm.client.run` then writes its command into the job's relay directory in
the run directory (shared by every node) and reads back what the host printed.

Each request is ``<id>.args`` (the argv, NUL-separated, renamed into place whole) and optionally
``<id>.in``; the host answers ``<id>.out``, ``<id>.err`` and, last, ``<id>.rc``. Only the five
commands above are run, each as an argv (never through a shell) under ``timeout``. The relay
ignores the job's signals, so a preemption's SIGTERM leaves it serving the requeue that follows;
it ends with the batch shell (SLURM ends the job's steps when that has ended) or at its teardown.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

RELAY_ENV = "LMLAUNCH_SLURM_RELAY"  # set in a container job's tasks: the relay directory of this job
RELAYED = ("scontrol", "sacct", "sinfo", "squeue", "scancel")
NOT_RELAYED = 126
POLL_S = 0.05

SCRIPT = "slurm_relay.sh"  # beside this module, in the run's code snapshot too


class RelayError(OSError):
    """The relay did not answer: no batch step serving this job (it ended, or never started)."""


def call(relay_dir: str, args: Sequence[str], *, timeout: float, input: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    """Run ``args`` on the host through the relay; what subprocess.run would have returned.
    :class:`subprocess.TimeoutExpired` when the host has not answered within ``timeout``."""
    d = Path(relay_dir)
    if not d.is_dir():
        raise RelayError(f"the SLURM relay directory {d} does not exist: the batch step did not start it")
    rid = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    base = d / rid
    try:
        if input is not None:
            (d / f"{rid}.in").write_text(input)
        tmp = d / f".{rid}.tmp"
        tmp.write_bytes(b"".join(a.encode() + b"\0" for a in args))
        os.replace(tmp, d / f"{rid}.args")
        deadline = time.monotonic() + timeout
        rc_file = Path(f"{base}.rc")
        while not rc_file.exists():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(list(args), timeout)
            time.sleep(POLL_S)
        code = int(rc_file.read_text().strip() or "1")
        out = Path(f"{base}.out").read_text(errors="replace")
        err = Path(f"{base}.err").read_text(errors="replace")
        return subprocess.CompletedProcess(list(args), code, out, err)
    finally:
        for suffix in (".args", ".run", ".in", ".out", ".err", ".rc"):
            Path(f"{base}{suffix}").unlink(missing_ok=True)
