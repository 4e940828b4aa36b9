"""The task's signals: one owner of the warning signal and SIGTERM in the training process.

Handlers only record (which signal, when) and call ``StopRequest.request``: no I/O, no
collective. The stop itself is agreed at a step boundary (``lmtrain.preemption.StopAgreement``).
:func:`own_signals` takes the signals over as soon as the task starts; DataLoader workers
ignore both (:class:`WorkerSignalGuard`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from lmtrain import faults

# Nothing heavy here, not even lmtrain.preemption.policy: this module is imported while submitit's
# handlers are still installed (tests/unit/test_preemption_signals.py holds it to that).

log = logging.getLogger(__name__)


@dataclass
class StopRequest:
    """A request to stop at the next optimizer-step boundary, checkpoint, and exit.

    A signal handler (:class:`SignalOwner`) only calls :meth:`request`: it sets fields, no I/O.
    ``armed`` turns on the per-step cross-rank agreement in :class:`lmtrain.preemption.StopAgreement`
    (one small all-reduce every ``check_every_n_steps``, the spec's
    ``preemption.agree_every_n_steps``); without a handler it stays off and
    costs nothing.
    """

    armed: bool = False
    check_every_n_steps: int = 1
    requested: bool = False
    reason: str | None = None  # a ledger reason: preempted, timeout, cancelled, ...
    detail: str | None = None
    requested_at: float | None = None
    agreed_step: int | None = None  # set when all ranks agreed and the checkpoint is on disk
    checkpoint_path: str | None = None

    def request(self, reason: str, detail: str | None = None) -> None:
        if not self.requested:
            self.reason, self.detail, self.requested_at = reason, detail, time.time()
        self.requested = True


@dataclass
class SignalRecord:
    """What the handlers saw in this process (written only by the handler, read by the loop)."""

    term_at: float | None = None
    warning_at: float | None = None
    count: int = 0

    @property
    def first_at(self) -> float | None:
        times = [t for t in (self.term_at, self.warning_at) if t is not None]
        return min(times) if times else None


class SignalOwner:
    """lmtrain's handlers for the warning signal and SIGTERM: record, request a stop, nothing more.

    ``install`` may be called again (after Lightning registered its handlers); ``restore`` puts
    back what was there before the first ``install``.
    """

    def __init__(self, stop: StopRequest, warning_signal: str = "USR2") -> None:
        self.stop = stop
        self.warning_signum = signal_number(warning_signal)
        self.warning_name = "SIG" + warning_signal.upper().removeprefix("SIG")
        self.record = SignalRecord()
        self.pid = os.getpid()
        self._previous: dict[int, Any] | None = None

    @property
    def signums(self) -> tuple[int, ...]:
        return (self.warning_signum, signal.SIGTERM)

    def install(self) -> bool:
        """(Re-)install the handlers. Only possible in the main thread of the owning process."""
        if threading.current_thread() is not threading.main_thread() or os.getpid() != self.pid:
            return False
        first = self._previous is None
        saved: dict[int, Any] = {}
        for signum in self.signums:
            saved[signum] = signal.signal(signum, self._handle)
        if first:
            self._previous = saved
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        # Runs between two bytecodes of the main thread: set fields only (no I/O, no locks,
        # no collectives, nothing that can block).
        if os.getpid() != self.pid:
            return  # a forked DataLoader worker: the training process handles the signal
        now = time.time()
        faults.open_gates()  # a run a test holds at a point goes on to this stop
        rec = self.record
        rec.count += 1
        if signum == signal.SIGTERM:
            if rec.term_at is None:
                rec.term_at = now
            self.stop.request("preempted", "SIGTERM")
        else:
            if rec.warning_at is None:
                rec.warning_at = now
            self.stop.request("timeout", self.warning_name)

    @property
    def installed(self) -> bool:
        return self._previous is not None

    def restore(self) -> None:
        if self._previous is None or os.getpid() != self.pid:
            return
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = None


_EARLY: SignalOwner | None = None


def own_signals(preemption: Any) -> SignalOwner:
    """Take the signals over as soon as the task starts, before anything heavy is imported: until
    then submitit's USR2 handler (checkpoint_and_try_requeue) would requeue the job from inside the
    handler, or end the task with "timed-out and not checkpointable" (seen when a time-limit warning
    came while the task imported torch). ``preemption`` is the plan's PreemptionPlan or its JSON
    dict (plan.json's ``preemption``): only its warning ``signal`` is read here, so the caller need
    not import the plan's classes first. What arrives now is kept and acted on at the first step
    boundary (:class:`Preemption` adopts this owner). Called again in the same process (the entry
    after lmtrain.task.main), it keeps the owner and what it recorded."""
    global _EARLY
    name = (preemption.get("signal") if isinstance(preemption, dict) else getattr(preemption, "signal", None)) or "USR2"
    if _EARLY is not None and _EARLY.installed and _EARLY.warning_signum != signal_number(name):
        _EARLY.restore()  # owned for another warning signal than the plan's
    if _EARLY is None or _EARLY.pid != os.getpid() or not _EARLY.installed:
        _EARLY = SignalOwner(StopRequest(), name)
    _EARLY.install()
    return _EARLY


def release_early_signals() -> None:
    """Give the signals back (an attempt that ends before training)."""
    if _EARLY is not None:
        _EARLY.restore()


def retire() -> None:
    """The task's attempt is over (its end is in the ledger) and the process is about to exit: from
    now on the warning signal is ignored. A time-limit warning may still come while the process
    exits (SLURM sends it up to a minute early); there is nothing left for it to stop, and the
    handler :meth:`SignalOwner.restore` gave back would do harm: the default action kills the
    process, so SLURM records a run that completed as FAILED (seen: a run done at step 70, killed
    by SIGUSR2 during its exit), and submitit's handler would requeue it. For the task's process
    body only (lmtrain.task.entry's run_slurm_task and main), not for in-process callers."""
    early = _EARLY
    if early is not None and early.pid == os.getpid() and threading.current_thread() is threading.main_thread():
        signal.signal(early.warning_signum, signal.SIG_IGN)


def carry_over(before: SignalOwner) -> None:
    """In a training process its task's agent forked (lmtrain.task.agent), after :func:`own_signals`:
    what the agent recorded while no training process could act on it (during its imports, between
    two training processes, or during one that ended asking for a restart), as if this process had
    received it; it is acted on at the first step boundary."""
    early = _EARLY
    if early is None or early.pid != os.getpid() or not before.stop.requested:
        return
    early.stop.request(before.stop.reason or "preempted", before.stop.detail)
    early.stop.requested_at = before.stop.requested_at
    rec, old = early.record, before.record
    rec.term_at = rec.term_at or old.term_at
    rec.warning_at = rec.warning_at or old.warning_at
    rec.count += old.count


def adopt_early(stop: StopRequest, warning_signal: str) -> SignalOwner | None:
    early = _EARLY
    if early is None or early.pid != os.getpid() or not early.installed:
        return None
    if early.warning_signum != signal_number(warning_signal):
        early.restore()
        return None
    before, early.stop = early.stop, stop
    if before.requested:
        stop.request(before.reason or "preempted", before.detail)
        stop.requested_at = before.requested_at
    return early


class WorkerSignalGuard:
    """A DataLoader ``worker_init_fn``: workers ignore SIGTERM and the warning signal.

    SLURM signals every process of a task, workers included. torch's workers install a C
    SIGTERM handler that kills the worker, and the training process would then fail at its next
    batch ("DataLoader worker exited unexpectedly") before it could reach the step boundary and
    checkpoint. Ignoring both lets the training process stop and shut its workers down itself
    (a worker whose parent died exits through torch's watchdog). Lightning's worker seeding
    (``seed_everything(workers=True)``) still runs, as Lightning would have added it.
    Picklable, so it also works with the spawn start method.
    """

    def __init__(self, signums: tuple[int, ...], rank: int, inner: Any = None) -> None:
        self.signums = tuple(int(s) for s in signums)
        self.rank = rank
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for signum in self.signums:
            signal.signal(signum, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)
        elif os.environ.get("PL_SEED_WORKERS") == "1":
            from lightning.fabric.utilities.seed import pl_worker_init_function

            pl_worker_init_function(worker_id, rank=self.rank)


def guard_dataloader_workers(loaders: Any, signums: tuple[int, ...], rank: int) -> None:
    """Give every multi-process DataLoader the :class:`WorkerSignalGuard`."""
    for loader in loaders:
        if loader is not None and getattr(loader, "num_workers", 0) > 0:
            if not isinstance(loader.worker_init_fn, WorkerSignalGuard):
                loader.worker_init_fn = WorkerSignalGuard(signums, rank, inner=loader.worker_init_fn)


def signal_number(name: str) -> int:
    """'USR2' / 'SIGUSR2' -> signal.SIGUSR2."""
    key = "SIG" + name.upper().removeprefix("SIG")
    try:
        return int(getattr(signal, key))
    except AttributeError:
        raise ValueError(f"unknown signal {name!r} in plan.preemption.signal") from None
