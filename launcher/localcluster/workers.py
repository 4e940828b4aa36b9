"""Worker clusters: one complete local cluster per parallel test worker.

The test suite runs its SLURM tests side by side (pytest-xdist). A test preempts with an exclusive
high-priority job, stops the controller, marks a node DOWN or switches the partition's PreemptMode:
on a shared cluster each of those would reach another worker's run. So each worker gets a cluster
of its own: the same nodes (n1, n2), partitions (low, high) and accounting as the primary one, with
its own state directory (``<primary>/workers/wK``), ports (the primary's + K x 100) and
``SLURM_CONF``. Only munged and /etc/hosts are the machine's.

A worker claims slot K by holding an flock on ``<primary>/workers/wK.claim`` for its life: two test
sessions running at once never share a cluster, and a slot whose owner died is free again. The
clusters stay up between sessions (``up`` is fast then); ``lmlaunch cluster down`` stops them with
the primary one.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from typing import IO

from launcher.localcluster.config import MAX_WORKER_SLOTS, Layout, Ports, primary_root
from lmcore.errors import UserError


@dataclass
class Claim:
    slot: int
    layout: Layout
    ports: Ports
    _handle: IO[str]

    version: str | None = None  # the SLURM version (None: the machine's own)

    def environ(self) -> dict[str, str]:
        """What a process (and the jobs it submits) needs to use this cluster, not the primary one."""
        from launcher.localcluster.cluster import environ_of

        return environ_of(self.layout, self.version)

    def release(self) -> None:
        self._handle.close()


def claim(version: str | None = None) -> Claim:
    """The first free worker slot of a SLURM version's clusters (None: the machine's own), held
    until :meth:`Claim.release` or this process ends."""
    for slot in range(1, MAX_WORKER_SLOTS + 1):
        got = claim_slot(slot, version)
        if got is not None:
            return got
    raise UserError(f"all {MAX_WORKER_SLOTS} worker clusters are claimed by running test sessions", exit_code=1)


def claim_slot(slot: int, version: str | None = None) -> Claim | None:
    """Worker slot ``slot``, held as :func:`claim` holds one; None while another process holds it
    (`cluster up --workers` then leaves that cluster as its session shaped it: more nodes, GPUs)."""
    folder = primary_root(version) / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / f"w{slot}.claim", "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return Claim(slot, Layout.worker(slot, version), Ports.for_slot(slot, version), handle, version)
