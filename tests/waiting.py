"""Waiting in the tests: bounded by progress, never by how fast this machine is.

A test that waits for work whose speed varies with the host (a job to start, a run to reach a
step, a checkpoint to complete, a requeue to begin, a process to write a file) waits while that
work advances and fails when it stalls: when nothing the wait watches has changed for
``STALL_S`` seconds. ``CAP_S`` is an overall cap, generous, for work that advances but never
arrives (a crash loop, a run that trains past its goal). On a host at half the speed, or beside
two CPU burners, a wait lasts twice as long and still passes; a hung job still fails, after
``STALL_S`` of silence rather than after a figure tuned on one machine.

What a wait watches (its ``progress``) is a function returning a value that changes when the work
advances: :func:`tree` (the files under a run directory: count, size, newest change),
:func:`job` (a SLURM job's state, reason, restarts and the size of its output), :func:`queue`
(every job of the cluster and its state: a pending job waits on those ahead of it),
:func:`process_cpu` (the CPU a local process tree has spent: importing torch writes nothing but
burns CPU). :func:`watching` combines several.

``HANG_S`` bounds a single command or process (``subprocess.run(..., timeout=HANG_S)``): it is not
a verdict on speed but a guard against a hang, far above any run of the commands the tests start.

``tests/unit/test_waits.py`` walks the test tree and fails on a literal wall-clock figure in a
wait (``timeout=120``, ``time.monotonic() + 60``, a hypothesis deadline), but for an allow-list
that says why for each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Seconds without any change in what a wait watches before it fails: longer than any silent phase
# of the work the tests wait on (the longest seen: a rank importing the training stack on a loaded
# 2-core machine, ~60 s, writing nothing meanwhile; a GraceTime of 30 s).
STALL_S = float(os.environ.get("LMLAUNCH_TEST_STALL_S", "240"))
# Overall cap of one wait that keeps advancing: the longest wait of the suite on a quiet machine is
# about 4 minutes (the 2D cluster case's reference run and preempted run).
CAP_S = float(os.environ.get("LMLAUNCH_TEST_CAP_S", "2400"))
# A hang guard for one command or process (not a verdict on its speed).
HANG_S = float(os.environ.get("LMLAUNCH_TEST_HANG_S", "1200"))
# How often a wait looks at its progress (SLURM commands, a walk of a run directory): often enough
# on the scale of STALL_S, rarely enough to cost the machine nothing next to the work it waits on.
PROGRESS_EVERY_S = 2.0


class Stalled(AssertionError):
    """A wait whose work stopped advancing (or ran past the overall cap)."""


def until(
    check: Callable[[], T],
    *,
    progress: Callable[[], Hashable],
    what: str,
    explain: Callable[[], str] | None = None,
    on_poll: Callable[[], object] | None = None,
    poll: float = 0.5,
    stall_s: float | None = None,
    cap_s: float | None = None,
) -> T:
    """Call ``check`` until it returns something truthy and return that. Fails (:class:`Stalled`)
    when ``progress()`` has not changed for ``stall_s`` seconds (default :data:`STALL_S`) or after
    ``cap_s`` seconds in all (default :data:`CAP_S`); the message says ``what`` was awaited, for how
    long, the last progress seen and ``explain()``. ``on_poll`` runs between checks (e.g. start a
    requeued job at once)."""
    stall = STALL_S if stall_s is None else stall_s
    cap = CAP_S if cap_s is None else cap_s
    start = last_change = looked = time.monotonic()
    mark = _safe(progress)
    while True:
        got = check()
        if got:
            return got
        now = time.monotonic()
        if now - looked >= PROGRESS_EVERY_S:  # progress matters on the stall's scale: look now and then
            looked = now
            seen = _safe(progress)
            if seen != mark:
                mark, last_change = seen, now
        if now - last_change > stall or now - start > cap:
            why = (f"nothing advanced for {now - last_change:.0f} s" if now - last_change > stall
                   else f"still advancing after the {cap:.0f} s cap")
            detail = ""
            if explain is not None:
                try:
                    detail = "\n" + explain()
                except Exception as e:  # an explanation must not hide the failure
                    detail = f"\n(explaining failed: {e!r})"
            raise Stalled(f"{what}: not reached after {now - start:.0f} s, {why}; last progress {mark!r}{detail}")
        if on_poll is not None:
            on_poll()
        time.sleep(poll)


def _safe(progress: Callable[[], Hashable]) -> Hashable:
    try:
        return progress()
    except Exception as e:  # a transient failure to look (a controller restarting) is a state too
        return ("error", type(e).__name__)


def watching(*parts: Callable[[], Hashable]) -> Callable[[], tuple]:
    """One progress function of several: it changes when any of them does."""
    return lambda: tuple(_safe(p) for p in parts)


def tree(*paths: Path | str) -> Callable[[], tuple]:
    """The files under ``paths`` (a run directory, a checkpoint folder): their count, total size
    and newest modification. Missing paths count as empty."""

    def look() -> tuple:
        count = size = newest = 0
        for root in paths:
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    count += 1
                    size += st.st_size
                    newest = max(newest, st.st_mtime_ns)
        return count, size, newest

    return look


def job(job_id: str) -> Callable[[], tuple]:
    """A SLURM job's state, pending reason, restart count and nodes, the size of its standard
    output and error files (they grow while its tasks log) and, for an lmlaunch run (its output in
    RUN/submitit/), the files of its run directory (:func:`tree`)."""

    run_dir: list[Callable[[], tuple]] = []

    def look() -> tuple:
        from lmcore.slurm import client as slurm

        info = slurm.show_job(job_id) or {}
        sizes = []
        for key in ("StdOut", "StdErr"):
            try:
                sizes.append(os.stat(info.get(key, "")).st_size)
            except (OSError, ValueError):
                sizes.append(-1)
        out = Path(info.get("StdOut") or "/")
        if not run_dir and out.parent.name == "submitit":  # an lmlaunch run: its run directory too
            run_dir.append(tree(out.parent.parent))
        files = run_dir[0]() if run_dir else ()
        return (info.get("JobState"), info.get("Reason"), info.get("Restarts"), info.get("NodeList"), *sizes, files)

    return look


def queue(ids: Iterable[str] | None = None) -> Callable[[], tuple]:
    """Every job of the cluster (or of ``ids``) and its state: a job pending on resources or a
    dependency advances when those ahead of it do."""
    wanted = list(ids) if ids is not None else None

    def look() -> tuple:
        from lmcore.slurm import client as slurm

        return tuple(sorted((j.job_id, j.state) for j in (slurm.squeue(wanted) if wanted is not None else slurm.squeue())))

    return look


def process_cpu(pid: int) -> Callable[[], int]:
    """CPU clock ticks spent by process ``pid`` and its descendants (alive ones): a process that
    computes advances even when it writes nothing."""

    def look() -> int:
        children: dict[int, list[int]] = {}
        ticks: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            p = int(entry)
            children.setdefault(int(fields[1]), []).append(p)
            ticks[p] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        total, todo = 0, [pid]
        while todo:
            p = todo.pop()
            total += ticks.get(p, 0)
            todo.extend(children.get(p, ()))
        return total

    return look


def file_grows(path: Path | str) -> Callable[[], int]:
    """The size of one file (-1 while it is missing)."""

    def look() -> int:
        try:
            return os.stat(path).st_size
        except OSError:
            return -1

    return look
