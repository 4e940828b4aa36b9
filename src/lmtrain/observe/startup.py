"""Where a (re)started attempt spends the time before its first training step.

Every task process marks the end of each startup phase on one clock (:data:`CLOCK`); rank 0
writes them into the ledger as one ``startup`` record (:class:`lmcore.run.rundir.AttemptStartup`)
once the first step is done, or when the attempt ends before it. ``lmlaunch history --timing``
shows the record per attempt. The phases, in the order a task goes through them
(:data:`lmcore.run.rundir.STARTUP_PHASES`):

- ``entry``: the Python process started (the kernel's start time of the process) -> lmtrain's
  entry runs (interpreter start, submitit unpickling the task);
- ``imports``: torch, lightning, transformers and the plan's schema imported, the plan read and
  the preemption signals owned;
- ``gate``: rank 0 read the ledger, judged the start gate and picked the checkpoint;
- ``rendezvous``: every rank knows the attempt, the master port and the checkpoint;
- ``data``: the token files opened and the sampler placed;
- ``model``: the LightningModule (and the transformers model) built, the Trainer made;
- ``restore``: ``fit`` started: process group, strategy setup, checkpoint read and loaded;
- ``first_step``: the first optimizer step of this attempt done.

No torch import here: the entry imports this module before anything heavy.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

from lmcore.run.rundir import STARTUP_PHASES, AttemptStartup
from lmtrain import faults


def process_start_time(pid: int | str = "self") -> float | None:
    """The start time of process ``pid`` (epoch seconds, 10 ms resolution), or None where /proc
    does not say (not Linux). Measured as its age (now - the kernel's start tick, both on the
    boot clock): /proc/stat's btime is whole seconds and would put it up to 1 s off."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        now = time.time()
        # field 22 (starttime, clock ticks after boot); the command name (field 2) may hold spaces
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return now - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """The end time of each startup phase of this process (the first mark of a phase counts)."""

    def __init__(self, process_start: float | None = None) -> None:
        self.process_start = process_start if process_start is not None else (process_start_time() or time.time())
        self.ends: dict[str, float] = {}
        self.backdated: dict[str, float] = {}

    def forked(self, process_start: float, backdated: dict[str, float] | None = None) -> None:
        """In a training process forked from its task's agent (lmtrain.task.agent): its start, and the
        phases the agent went through for it (the first one's imports), which its marks then take."""
        self.process_start, self.ends, self.backdated = process_start, {}, dict(backdated or {})

    def begin_attempt(self) -> None:
        """An attempt starts in this process: the first one at the process's start; a later one
        (a tool or bench calling the entry again in the same process) now, with no marks yet."""
        if self.ends:
            self.process_start, self.ends = time.time(), {}

    def mark(self, phase: str, at: float | None = None) -> None:
        if phase not in STARTUP_PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; phases: {', '.join(STARTUP_PHASES)}")
        if phase not in self.ends:
            back = self.backdated.pop(phase, None)
            self.ends[phase] = back if back is not None else (time.time() if at is None else at)
            faults.point(f"startup.{phase}")  # the fault seam: a test holds a task at this moment of its start

    def record(self, attempt: int, job_id: str | None, checkpoint_bytes: int | None) -> AttemptStartup:
        return AttemptStartup(
            attempt=attempt, job_id=job_id, process_start=round(self.process_start, 3),
            phases={p: round(self.ends[p] - self.process_start, 3) for p in STARTUP_PHASES if p in self.ends},
            checkpoint_bytes=checkpoint_bytes,
        )


CLOCK = StartupClock()


@contextlib.contextmanager
def imports_without_gc(*, freeze: bool) -> Iterator[None]:
    """Import the frameworks with Python's cyclic garbage collector paused and, with ``freeze``, freeze
    what they made. Importing torch, Lightning and transformers allocates millions of objects and
    almost no garbage, and the collector would walk them over and over while they load: about a
    third of the ~5 CPU-s a task spends importing (bench/task_imports.py). Frozen, they are left out
    of every later collection too (the training loop's). Freeze only in a process that starts with
    these imports (a task): frozen objects are never collected, and a process that already holds
    other objects (a test calling the entry in-process) would keep its garbage of the moment for
    good. The collector runs again as it did before, also when an import fails."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
