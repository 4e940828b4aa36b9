"""Hang watchdog: a rank that makes no progress dumps every thread's stack and ends the task.

A distributed job hangs when one rank stops (a deadlock, a stuck filesystem, a lost peer) and
every other rank waits for it inside a collective. Collectives have a timeout (the process
group's ``timeout=``, spec ``watchdog.collective_timeout_s``), but a rank can hang outside a
collective too, and a timeout alone says nothing about *where* it hung. So each rank runs a
watchdog on the progress of its training loop:

- every training/validation batch and every checkpoint write is a *beat*
  (:class:`WatchdogCallback`);
- a Python thread wakes up about once a second; when the last beat is older than
  ``hang_timeout_s`` it writes all thread stacks (``faulthandler.dump_traceback(all_threads=True)``)
  to ``logs/attempt-<N>/stacks-rank-<R>.txt``, leaves a marker ``hang-rank-<R>.json`` next to
  it, writes the ledger ``end`` line with reason ``hang`` (rank 0; once per process, see
  :meth:`lmcore.run.rundir.Ledger.write_end_once`) and ends the process with :data:`EXIT_HANG`, so SLURM sees a failed
  task and the requeue logic can read why;
- the Python thread needs the GIL. A C call that holds it forever would keep the thread from
  running, so a C-level timer (``faulthandler.dump_traceback_later(exit=True)``, a thread of
  the interpreter's own that does not take the GIL) is armed ``exit_grace_s`` later: it dumps
  the stacks into the same file and ``_exit``\\ s the process.

A rank whose peer hung sees its collective fail (the peer's process is gone) before its own
watchdog fires; :func:`hang_reason` turns that failure into ``hang`` when a peer left a marker
or the error is a collective timeout, so the ledger says why in both orders.

The hang tests stop a rank at the ``watchdog.beat`` point of the fault-injection seam
(``lmtrain.faults``); the other ranks then wait in the next step's gradient all-reduce.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from lmcore.atomic import write_private
from lmcore.run.rundir import HANG_MARKER, RunLayout
from lmtrain import faults

if TYPE_CHECKING:
    from lmtrain.observe.attempt import AttemptRecords

log = logging.getLogger(__name__)

EXIT_HANG = 124  # like timeout(1): the task ended because it stopped making progress
REASON_HANG = "hang"
REARM_EVERY_S = 1.0  # the C-level timer is re-armed at most this often (each re-arm starts a thread)
LINGER_S = 2.0  # after dumping, wait a moment so peers that hang on us dump while still stuck

# Words of the errors torch raises when a collective times out (gloo: "Timed out waiting ... for
# recv", "Application timeout caused pair closure"; NCCL: "Watchdog caught collective operation timeout").
_COLLECTIVE_TIMEOUT_MARKERS = ("Timed out", "timed out", "Application timeout", "collective operation timeout")


def hang_markers(layout: RunLayout, attempt: int) -> list[dict[str, Any]]:
    """The hang reports ranks of this attempt left (empty when none hung)."""
    out = []
    for p in sorted(layout.attempt_logs(attempt).glob(layout.hang_marker(attempt, "*").name)):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # being written
    return out


def hang_reason(exc: BaseException | None, layout: RunLayout, attempt: int) -> str | None:
    """``hang`` when this attempt failed because a rank hung: a peer's watchdog left a marker,
    or the error is a collective timeout. None otherwise (a plain crash)."""
    if hang_markers(layout, attempt):
        return REASON_HANG
    if exc is not None and any(m in f"{exc}" for m in _COLLECTIVE_TIMEOUT_MARKERS):
        return REASON_HANG
    return None


# --------------------------------------------------------------------------- the watchdog


@dataclass(frozen=True)
class HangReport:
    rank: int
    attempt: int
    step: int
    idle_s: float
    timeout_s: float
    stacks: str
    time: float

    def detail(self) -> str:
        return (
            f"rank {self.rank} made no progress for {self.idle_s:.0f} s (hang_timeout_s {self.timeout_s:.0f}) "
            f"after step {self.step}; stacks in {self.stacks}"
        )


class ProgressWatchdog:
    """Ends the process when :meth:`beat` was not called for ``timeout_s`` seconds.

    ``on_hang(report)`` runs in the watchdog thread after the stacks are on disk and before
    the process exits (with ``exit_code``; tests pass ``exit=False`` to keep the process).
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        stacks_file: str | Path,
        marker_file: str | Path,
        rank: int,
        attempt: int,
        grace_s: float = 15.0,
        on_hang: Callable[[HangReport], None] | None = None,
        exit: bool = True,
        exit_code: int = EXIT_HANG,
        poll_s: float = 1.0,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.stacks_file = Path(stacks_file)
        self.marker_file = Path(marker_file)
        self.rank, self.attempt = rank, attempt
        self.on_hang = on_hang
        self.exit, self.exit_code = exit, exit_code
        self.poll_s = min(poll_s, max(0.05, self.timeout_s / 4))
        self.step = 0
        self.fired = threading.Event()
        self._last = time.monotonic()
        self._armed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: TextIO | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.stacks_file.parent.mkdir(parents=True, exist_ok=True)
        # Kept open for the C-level timer, which writes to the file descriptor by itself.
        self._file = open(self.stacks_file, "a", buffering=1)
        self._last = time.monotonic()
        self._arm_backstop(force=True)
        self._thread = threading.Thread(target=self._run, name="lmtrain-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Disarm (end of training, or the main thread is handling an error itself)."""
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._file is not None and not self.fired.is_set():
            self._file.close()
            self._file = None
            if self.stacks_file.exists() and self.stacks_file.stat().st_size == 0:
                self.stacks_file.unlink()  # nothing hung: leave no empty file behind

    def beat(self, step: int | None = None) -> None:
        """Progress: called from the training loop (cheap; no I/O)."""
        self._last = time.monotonic()
        if step is not None:
            self.step = step
        self._arm_backstop()

    # -- internals -----------------------------------------------------------------------
    def _arm_backstop(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._stop.is_set() or self._file is None or (not force and now - self._armed_at < REARM_EVERY_S):
            return
        self._armed_at = now
        # Fires only if the Python thread could not act: timeout + grace (+ up to one re-arm period).
        faulthandler.dump_traceback_later(
            self.timeout_s + self.grace_s, repeat=False, file=self._file, exit=self.exit
        )

    def idle_s(self) -> float:
        return time.monotonic() - self._last

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = self.idle_s()
            if idle >= self.timeout_s:
                self._fire(idle)
                return

    def _linger(self) -> None:
        """Stay a moment so peers hanging on us dump their stacks while still stuck; a rank other
        than 0 waits (up to the grace time) for rank 0's report, so that rank 0's own watchdog,
        not a broken collective, writes the ledger line."""
        deadline = time.monotonic() + (self.grace_s if self.rank != 0 else LINGER_S)
        rank0 = self.marker_file.with_name(HANG_MARKER.format(rank=0))
        time.sleep(min(LINGER_S, self.grace_s))
        while self.rank != 0 and not rank0.exists() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _fire(self, idle: float) -> None:
        self.fired.set()
        report = HangReport(
            rank=self.rank, attempt=self.attempt, step=self.step, idle_s=idle, timeout_s=self.timeout_s,
            stacks=str(self.stacks_file), time=time.time(),
        )
        f = self._file
        if f is None:  # stopped between the check and now
            return
        f.write(
            f"lmtrain watchdog: {time.strftime('%Y-%m-%d %H:%M:%S')} {report.detail()}; "
            f"pid {os.getpid()}; stacks of all threads (most recent call first):\n"
        )
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
        write_private(self.marker_file, json.dumps(report.__dict__) + "\n")
        try:
            if self.on_hang is not None:
                self.on_hang(report)
        except Exception:
            log.exception("watchdog: reporting the hang failed")
        log.error("watchdog: %s; ending this task with exit code %d", report.detail(), self.exit_code)
        log.error("watchdog: while the job still runs, `lmlaunch stacks %s --native` shows the live stacks of "
                  "the ranks still there (a peer stuck in a collective, a C call)", os.environ.get("SLURM_JOB_ID") or "RUN")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        faulthandler.cancel_dump_traceback_later()  # this thread runs: the C-level backstop is not needed
        if self.exit:
            self._linger()
            os._exit(self.exit_code)


# --------------------------------------------------------------------------- Lightning wiring


def __getattr__(name: str) -> Any:
    # The Lightning callback is built on first use: the watchdog itself imports no Lightning
    # (its unit tests start plain interpreters).
    if name == "WatchdogCallback":
        cls = _make_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_callback_class() -> type:
    import lightning.pytorch as pl

    class WatchdogCallback(_WatchdogHooks, pl.Callback):
        pass

    WatchdogCallback.__doc__ = _WatchdogHooks.__doc__
    WatchdogCallback.__module__ = __name__
    return WatchdogCallback


class _WatchdogHooks:
    """Beats on every batch and checkpoint; arms at train start, disarms at the end.

    Put it LAST in the Trainer's callbacks so its ``on_train_batch_end`` beat comes after a
    checkpoint written in the same hook (``on_save_checkpoint`` beats during the write).
    """

    def __init__(self, *, timeout_s: float, grace_s: float, records: AttemptRecords,
                 ended: Callable[[HangReport], None] | None = None) -> None:
        self.records, self.ended = records, ended
        self.rank, attempt = records.env.rank, records.attempt
        self.watchdog = ProgressWatchdog(
            timeout_s=timeout_s, grace_s=grace_s, rank=self.rank, attempt=attempt,
            stacks_file=records.layout.stacks(attempt, self.rank),
            marker_file=records.layout.hang_marker(attempt, self.rank), on_hang=self._report,
        )

    def _report(self, report: HangReport) -> None:
        # rank 0 writes the ledger (its own watchdog, or hang_reason when its collective fails),
        # with the attempt's decision where the caller makes one (a restart in place)
        if self.ended is not None and self.rank == 0:
            self.ended(report)
        else:
            self.records.hung(report.step, report.detail(), report.time)

    # -- hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.watchdog.step = trainer.global_step
        self.watchdog.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.watchdog.beat(trainer.global_step)
        faults.point("watchdog.beat", step=trainer.global_step, rank=self.rank)  # the hang tests stop a rank here

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int=0) -> None:
        self.watchdog.beat()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.watchdog.beat()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.watchdog.beat()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.watchdog.beat()  # the final checkpoint is written next (CheckpointCallback)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.watchdog.fired.is_set():
            return
        self.watchdog.stop()
        layout, attempt = self.records.layout, self.records.attempt
        hung = hang_markers(layout, attempt)
        if hung:
            # a peer hung and its exit broke our collective: record where this rank was too
            with open(layout.stacks(attempt, self.rank), "a") as f:
                f.write(f"lmtrain watchdog: rank {self.rank}: a peer hung ({hung}); "
                        f"this rank's collective failed with {type(exception).__name__}: {exception}; stacks:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self.watchdog.fired.is_set():
            self.watchdog.stop()
