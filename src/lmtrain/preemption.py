"""Preemption, time limits and requeue: one owner of signals, a stop agreed at a step boundary,
a complete checkpoint, then one decision (rank 0) about why the attempt ended and whether the
job requeues itself.

The path of a stop (issue 5, docs/run-directory.md for the ledger):

1. :class:`SignalOwner` installs handlers for the warning signal (``plan.preemption.signal``,
   USR2 by default) and SIGTERM in the training process only. They are installed when the
   task starts and installed again in ``on_train_start``, after Lightning's ``Trainer.fit``
   registered its own SIGTERM handler (which does a collective inside the handler and would
   deadlock when ranks get the signal at different times): from then on ours are the only
   ones. A handler records the signal (which, when) and calls ``StopRequest.request``; it does
   no I/O and no collective. In any other process (a forked DataLoader worker inherits the
   handlers) it does nothing, and DataLoader workers ignore both signals
   (:class:`WorkerSignalGuard`: torch's own worker SIGTERM handler would kill them and crash
   the training process before it reaches the step boundary).
2. :class:`StopAgreement`, at every optimizer-step boundary, runs ONE all-reduce (MAX) of a
   4-number tensor ``[stop requested, SIGTERM seen, warning seen, -first signal time]``: every
   rank learns at the same step that some rank was asked to stop, and which signals arrived
   where. All ranks then take part in the checkpoint (CheckpointManager.save: COMPLETE after
   every rank finished, ``latest`` last) and the Trainer stops.
3. After the fit, rank 0 :func:`decide` s the ledger reason from the signals, the run's markers
   (``CANCELLED``, ``DONE``), the job's SLURM state (``launcher.slurm``, from the main loop,
   never from the handler) and the loop guards; the ledger ``end`` line is written; then
   :meth:`Preemption.after_end` calls ``scontrol requeue`` LAST when the job must requeue
   itself (a time limit; a stop whose job SLURM is not already requeueing).
4. At the start of the next attempt :func:`start_gate` (rank 0, before the rendezvous, its
   answer published for the other ranks) records a previous attempt that has no ``end`` line
   (node failure / SIGKILL) and ends at once, without training, an attempt of a run that is
   ``DONE`` or ``CANCELLED`` or over a loop guard.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# SLURM states in which the controller already takes care of the job: do not requeue it again.
_SLURM_REQUEUEING = ("PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING", "CONFIGURING")
# The time-limit warning may arrive up to 60 s before warning_seconds; allow that much slack.
WARNING_SLACK_S = 90.0
SLURM_QUERY_TIMEOUT_S = 10.0
GATE_NAME = "{key}.gate.json"
# docs/run-directory.md: what the ledger's `reason` may say.
LEDGER_REASONS = frozenset({"completed", "preempted", "timeout", "node_failure", "cancelled", "crashed",
                            "no_progress", "limit_reached", "hang"})


# --------------------------------------------------------------------------- signals
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

    def __init__(self, stop, warning_signal: str = "USR2") -> None:
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
        if first:
            self._previous = {}
        for signum in self.signums:
            previous = signal.signal(signum, self._handle)
            if first:
                self._previous[signum] = previous
        return True

    def _handle(self, signum: int, frame) -> None:
        # Runs between two bytecodes of the main thread: set fields only (no I/O, no locks,
        # no collectives, nothing that can block).
        if os.getpid() != self.pid:
            return  # a forked DataLoader worker: the training process handles the signal
        now = time.time()
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


def own_signals(plan) -> SignalOwner:
    """Take the signals over as soon as the task starts, before the rendezvous and the imports of
    the model: until then submitit's USR2 handler (checkpoint_and_try_requeue) would requeue the
    job from inside the handler. What arrives now is kept and acted on at the first step
    boundary (:class:`Preemption` adopts this owner)."""
    global _EARLY
    from lmtrain.callbacks import StopRequest

    if _EARLY is None or _EARLY.pid != os.getpid() or not _EARLY.installed:
        _EARLY = SignalOwner(StopRequest(), Policy.from_plan(plan.preemption).signal)
    _EARLY.install()
    return _EARLY


def _adopt_early(stop, warning_signal: str) -> SignalOwner | None:
    early = _EARLY
    if early is None or early.pid != os.getpid() or not early.installed:
        return None
    if early.warning_signum != signal_number(warning_signal):
        early.restore()
        return None
    before, early.stop = early.stop, stop
    if before.requested:
        stop.request(before.reason, before.detail)
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

    def __init__(self, signums: tuple[int, ...], rank: int, inner=None) -> None:
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


def guard_dataloader_workers(loaders, signums: tuple[int, ...], rank: int) -> None:
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


# --------------------------------------------------------------------------- the ledger
def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Whole JSON lines of a ledger/heartbeat file; a line being written (or torn) is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


@dataclass
class AttemptRow:
    """One attempt of the run as the ledger tells it."""

    attempt: int
    job_id: str | None
    start_step: int
    end_step: int | None = None
    reason: str | None = None  # None: no end line (yet)
    requeued: bool = False
    skipped: bool = False  # ended by the start gate, without training


def attempt_rows(entries: list[dict[str, Any]]) -> list[AttemptRow]:
    rows: dict[int, AttemptRow] = {}
    for e in entries:
        n = e.get("attempt")
        if not isinstance(n, int):
            continue
        if e.get("event") == "start":
            rows[n] = AttemptRow(attempt=n, job_id=e.get("job_id"), start_step=int(e.get("start_step") or 0))
        elif e.get("event") == "end" and n in rows:
            row = rows[n]
            row.end_step = e.get("end_step")
            row.reason = e.get("reason")
            row.requeued = bool(e.get("requeued"))
            row.skipped = bool(e.get("skipped"))
    return [rows[n] for n in sorted(rows)]


def steps_without_progress(starts: list[int], current: int) -> int:
    """How many consecutive attempts, newest last, ended where they started: attempt i made
    progress when the next one started later (``current`` is where the newest one got to)."""
    ends = [*starts[1:], current]
    n = 0
    for start, end in zip(reversed(starts), reversed(ends)):
        if end > start:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- decisions (pure)
@dataclass
class Policy:
    """plan.preemption (spec.preemption + what the profile says about the cluster)."""

    signal: str = "USR2"
    warning_seconds: int = 120
    max_requeues: int = 20
    max_timeouts: int = 10
    max_crash_retries: int = 2
    no_progress_attempts: int = 3
    cluster_sends_user_signal: bool = False

    @classmethod
    def from_plan(cls, preemption: dict[str, Any]) -> Policy:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in preemption.items() if k in names and v is not None})


@dataclass
class EndFacts:
    """Everything rank 0 knows when an attempt's training ended."""

    end_step: int
    start_step: int
    max_steps: int
    checkpoint_step: int | None  # newest complete checkpoint now
    stopped: bool  # all ranks agreed on a stop and its checkpoint is complete
    crashed: bool  # an exception, or the Trainer stopped early without a stop
    term: bool = False
    warning: bool = False
    warning_name: str = "SIGUSR2"
    requested_reason: str | None = None  # a stop requested without a signal (tests, tools)
    error: str | None = None
    cancelled_marker: bool = False
    launcher: str = "slurm"
    job_id: str = ""
    restart_count: int = 0
    slurm_state: str | None = None  # JobState now; None: not SLURM or SLURM did not answer
    preempting: bool = False  # scontrol shows a PreemptTime: SLURM is preempting (and will requeue) it
    seconds_left: float | None = None  # until the job's time limit, at the signal
    slurm_restarts: int | None = None  # the job's Restarts now: above restart_count = SLURM requeued it already
    nodes_down: list[str] = field(default_factory=list)  # this attempt's nodes that SLURM has DOWN/failed now
    history: list[AttemptRow] = field(default_factory=list)  # earlier attempts of the run


@dataclass
class Decision:
    reason: str
    detail: str
    requeued: bool  # the job will run again (by SLURM or by us)
    action: str | None = None  # "requeue" | "cancel" | None: what rank 0 does LAST
    exit_code: int = 0


def _state_word(state: str | None) -> str:
    return state.split()[0].rstrip("+").upper() if state and state.strip() else ""


def _signal_names(f: EndFacts) -> str:
    names = [n for n, seen in ((f.warning_name, f.warning), ("SIGTERM", f.term)) if seen]
    return " + ".join(names)


def classify_stop(f: EndFacts, policy: Policy) -> tuple[str, str]:
    """(reason, why) of a stop: timeout, preempted, or a requested reason."""
    state = _state_word(f.slurm_state)
    left = f.seconds_left
    near_limit = left is not None and left <= policy.warning_seconds + WARNING_SLACK_S
    sigs = _signal_names(f)
    when = f" {left:.0f} s before the time limit" if left is not None else ""
    if state == "TIMEOUT" or ((f.warning or f.term) and near_limit):
        return "timeout", f"{sigs}{when}"
    if f.term:
        return "preempted", f"SIGTERM{when}" + (f" (JobState {state})" if state else "")
    if f.warning:
        if left is None and not policy.cluster_sends_user_signal and state != "PREEMPTED" and not f.preempting:
            return "timeout", f"{f.warning_name} (time to the limit unknown: taken as the time-limit warning)"
        return "preempted", f"{f.warning_name}{when}, not at the time limit"
    reason = f.requested_reason if f.requested_reason in LEDGER_REASONS else "preempted"
    return reason, f"stop requested ({f.requested_reason})" if f.requested_reason else "stop requested"


def decide(f: EndFacts, policy: Policy) -> Decision:
    """Why the attempt ended, and whether (and by whom) the job runs again."""
    state = _state_word(f.slurm_state)
    ckpt = f"checkpoint step-{f.checkpoint_step} complete" if f.checkpoint_step is not None else "no checkpoint"
    if f.end_step >= f.max_steps and not f.crashed:
        return Decision("completed", f"reached max_steps({f.max_steps})", requeued=False)
    if f.cancelled_marker or state == "CANCELLED":
        why = "CANCELLED marker in the run directory" if f.cancelled_marker else "JobState CANCELLED"
        sig = _signal_names(f)
        return Decision("cancelled", f"{why}{'; ' + sig if sig else ''}; {ckpt}; never requeued", requeued=False)

    if f.nodes_down:
        # SLURM set a node of this job DOWN: it kills the steps (SIGTERM when the node's slurmd
        # still answers) and requeues the job itself (NODE_FAIL in accounting).
        reason, why = "node_failure", f"node {', '.join(f.nodes_down)} DOWN" + (
            f" ({_signal_names(f)})" if f.warning or f.term else "")
        detail = f"{why}; {ckpt}"
    elif f.warning or f.term or (f.stopped and not f.crashed):
        reason, why = classify_stop(f, policy)
        detail = f"{why}; {ckpt}"
        if f.crashed and f.error:
            detail += f"; then {f.error}"
    else:
        reason = "crashed"
        detail = f.error or "the Trainer stopped before max_steps without a stop request"
        detail += f"; resumes from {ckpt}" if f.checkpoint_step is not None else ""
    exit_code = 1 if reason == "crashed" else 0

    # During the partition's GraceTime a preempted job still shows RUNNING, with a PreemptTime;
    # it must requeue itself all the same: slurm 22.05 ends a preempted job whose tasks exit
    # within GraceTime as COMPLETED and never requeues it (seen on the local cluster).
    slurm_requeues = state in _SLURM_REQUEUEING or (
        f.slurm_restarts is not None and f.slurm_restarts > f.restart_count)
    if f.launcher != "slurm":
        return Decision(reason, detail + "; local run: not requeued", requeued=False, exit_code=exit_code)
    if state == "COMPLETING" and not slurm_requeues and reason != "timeout":
        # SLURM is tearing the job down and accounting did not say why (scancel shows COMPLETING,
        # not CANCELLED, while the tasks run): a requeue could undo a user's cancel.
        return Decision(reason, detail + "; JobState COMPLETING and accounting did not say why (a bare scancel?): "
                        "not requeued", requeued=False, exit_code=exit_code)

    # --- loop guards --------------------------------------------------------------------------
    job_hist = [a for a in f.history if a.job_id == f.job_id]
    stop_why = None
    stop_reason = "limit_reached"
    if reason == "crashed":
        retries = sum(1 for a in job_hist if a.reason == "crashed" and a.requeued)
        if retries >= policy.max_crash_retries:
            stop_why, stop_reason = f"max_crash_retries({policy.max_crash_retries}) reached", "crashed"
    if stop_why is None and f.restart_count >= policy.max_requeues:
        stop_why = f"max_requeues({policy.max_requeues}) reached ({f.restart_count} requeues)"
    if stop_why is None and reason == "timeout":
        timeouts = 1 + sum(1 for a in job_hist if a.reason == "timeout")
        if timeouts > policy.max_timeouts:
            stop_why = f"max_timeouts({policy.max_timeouts}) reached ({timeouts} time limits)"
    if stop_why is None:
        starts = [a.start_step for a in f.history if not a.skipped] + [f.start_step]
        current = f.checkpoint_step if f.checkpoint_step is not None else f.start_step
        stuck = steps_without_progress(starts, current)
        if stuck >= policy.no_progress_attempts:
            stop_why, stop_reason = (
                f"the global step stayed at {current} over {stuck} attempts "
                f"(no_progress_attempts={policy.no_progress_attempts})"
            ), "no_progress"
    if stop_why is not None:
        detail = f"{reason}: {detail}; {stop_why}; not requeued"
        # SLURM requeues a preempted job by itself: cancel it so it does not start again.
        return Decision(stop_reason, detail, requeued=False, action="cancel" if slurm_requeues else None,
                        exit_code=exit_code)

    if slurm_requeues:
        return Decision(reason, detail + f"; requeued by SLURM (JobState {state})", requeued=True, exit_code=exit_code)
    by = " during the preemption's GraceTime (PreemptTime set)" if f.preempting else ""
    return Decision(reason, detail + f"; requeued (scontrol requeue{by})", requeued=True, action="requeue",
                    exit_code=exit_code)


@dataclass
class StartFacts:
    done_marker: bool
    cancelled_marker: bool
    start_step: int  # newest complete checkpoint
    restart_count: int
    job_id: str
    history: list[AttemptRow]
    previous_state: str | None = None  # SLURM's state of the previous attempt (sacct -D), if known
    max_steps: int | None = None  # the plan's trainer.max_steps (None: a DONE marker is final)
    done_step: int | None = None  # the step the DONE marker records (None: unknown, final)


@dataclass
class Gate:
    """The start gate's answer: ``exit`` -> end this attempt at once with ``reason``."""

    exit: bool
    reason: str | None = None
    detail: str | None = None
    previous_end: dict[str, Any] | None = None  # an end line for an earlier attempt without one

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


_PREVIOUS_REASONS = {"NODE_FAIL": "node_failure", "PREEMPTED": "preempted", "TIMEOUT": "timeout",
                     "CANCELLED": "cancelled", "OUT_OF_MEMORY": "crashed", "FAILED": "crashed"}


def start_gate(f: StartFacts, policy: Policy) -> Gate:
    """Before training: record an earlier attempt that never wrote its end, and refuse to train a
    run that is finished, cancelled or over a loop guard."""
    previous_end = None
    if f.history and f.history[-1].reason is None:
        prev = f.history[-1]
        reason = _PREVIOUS_REASONS.get(_state_word(f.previous_state), "node_failure")
        seen = f" (SLURM: {_state_word(f.previous_state)})" if f.previous_state else ""
        previous_end = {
            "event": "end", "attempt": prev.attempt, "job_id": prev.job_id, "time": time.time(),
            "end_step": f.start_step, "reason": reason,
            "detail": (f"attempt {prev.attempt} has no end line: its tasks were killed without a chance to "
                       f"write it (node failure, SIGKILL){seen}; recorded at the start of the next attempt, "
                       f"which resumes from step {f.start_step}"),
            "requeued": True,
        }
        prev.reason, prev.end_step, prev.requeued = reason, f.start_step, True
    if f.done_marker and (f.max_steps is None or f.done_step is None or f.done_step >= f.max_steps):
        return Gate(True, "completed", "the run already finished (DONE marker): not training again", previous_end)
    # DONE at a step below max_steps: the run was continued to a larger
    # trainer.max_steps (submit --resume trainer.max_steps=N); it trains on.
    if f.cancelled_marker:
        return Gate(True, "cancelled", "the run is cancelled (CANCELLED marker): not training again", previous_end)
    if f.restart_count > policy.max_requeues:
        return Gate(True, "limit_reached",
                    f"max_requeues({policy.max_requeues}) reached ({f.restart_count} requeues): not training again",
                    previous_end)
    starts = [a.start_step for a in f.history if not a.skipped]
    stuck = steps_without_progress(starts, f.start_step) if starts else 0
    if stuck >= policy.no_progress_attempts:
        return Gate(True, "no_progress",
                    f"the global step stayed at {f.start_step} over the last {stuck} attempts "
                    f"(no_progress_attempts={policy.no_progress_attempts}): not training again", previous_end)
    return Gate(False, previous_end=previous_end)


# --------------------------------------------------------------------------- SLURM facts (main loop only)
def _slurm_job_facts(job_id: str) -> dict[str, str] | None:
    """`scontrol show job` of this job, or None when SLURM does not answer in time."""
    try:
        from launcher import slurm

        return slurm.show_job(job_id, timeout=SLURM_QUERY_TIMEOUT_S)
    except Exception as exc:  # SLURM down, no client, a timeout: decide without it
        log.warning("could not read the state of job %s from SLURM: %s", job_id, exc)
        return None


def _seconds_left(info: dict[str, str] | None, at: float) -> float | None:
    """Seconds from ``at`` to the job's time limit: StartTime + TimeLimit. Not EndTime: when
    SLURM preempts a job it moves EndTime to now + GraceTime (seen on 22.05), which would read
    as "at the time limit" and turn every preemption into a timeout."""
    info = info or {}
    try:
        start = time.mktime(time.strptime(info.get("StartTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None  # Unknown / None
    limit = _limit_seconds(info.get("TimeLimit", ""))
    return None if limit is None else start + limit - at


def _limit_seconds(text: str) -> float | None:
    """SLURM's TimeLimit ('D-HH:MM:SS', 'HH:MM:SS', 'MM:SS', 'UNLIMITED') in seconds."""
    days, _, hms = text.rpartition("-")
    parts = hms.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    secs = 0
    for p in parts:
        secs = secs * 60 + int(p)
    return secs + int(days or 0) * 86400


def _nodes_down(nodes: list[str]) -> list[str]:
    """Which of ``nodes`` SLURM has DOWN / failing now (sinfo), from the main loop only."""
    try:
        from launcher import slurm

        states = {n.name: n.state for n in slurm.nodes(timeout=SLURM_QUERY_TIMEOUT_S)}
    except Exception as exc:
        log.warning("could not read the node states from SLURM: %s", exc)
        return []
    return [n for n in nodes if states.get(n, "").rstrip("*~#!%$@^-+").startswith(("down", "fail"))]


def _nodes_failed(env, info: dict[str, str]) -> list[str]:
    """Nodes of this attempt that failed: DOWN in sinfo now, or, when SLURM already requeued the
    job while it runs (Restarts grew: it does so at once on a node failure, only after the tasks
    ended on a preemption), NODE_FAIL in accounting for this attempt. A DOWN node whose slurmd
    still answers may be back in service within seconds (ReturnToService=2), hence both."""
    down = _nodes_down(env.nodes)
    restarts = info.get("Restarts", "")
    if down or not restarts.isdigit() or int(restarts) <= env.restart_count:
        return down
    from launcher import slurm

    for _ in range(6):  # accounting lags the controller by a moment
        try:
            rows = slurm.sacct([env.job_id], duplicates=True, timeout=SLURM_QUERY_TIMEOUT_S)
        except Exception as exc:
            log.warning("could not read job %s from accounting: %s", env.job_id, exc)
            return []
        if len(rows) > env.restart_count and _state_word(rows[env.restart_count].state):
            word = _state_word(rows[env.restart_count].state)
            if word == "NODE_FAIL":
                return [f"{rows[env.restart_count].nodes} (NODE_FAIL)"]
            if word not in ("RUNNING", "COMPLETING", "PENDING"):
                return []
        time.sleep(0.5)
    return []


# Terminal states accounting records for an attempt the moment SLURM ends it (the controller
# shows them all as COMPLETING while the tasks still run).
_ENDING_STATES = ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "FAILED", "OUT_OF_MEMORY", "DEADLINE")


def _why_completing(env, info: dict[str, str] | None) -> str | None:
    """The real state behind ``JobState=COMPLETING`` (slurm 22.05 prints COMPLETING for a job
    being cancelled, timed out, failed or requeued): this attempt's row in accounting."""
    info = info or {}
    if _state_word(info.get("JobState")) != "COMPLETING":
        return None
    restarts = info.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > env.restart_count:
        return None  # a requeue: the Restarts rule already covers it
    from launcher import slurm

    for _ in range(6):  # accounting lags the controller by a moment
        try:
            rows = slurm.sacct([env.job_id], duplicates=True, timeout=SLURM_QUERY_TIMEOUT_S)
        except Exception as exc:
            log.warning("could not read job %s from accounting: %s", env.job_id, exc)
            return None
        row = rows[env.restart_count] if len(rows) > env.restart_count else (rows[-1] if rows else None)
        if row is not None and _state_word(row.state) in _ENDING_STATES:
            return row.state
        time.sleep(0.5)
    return None


def _previous_attempt_state(job_id: str) -> str | None:
    """SLURM accounting's state of the previous run of this job (`sacct -D`), if it has one."""
    try:
        from launcher import slurm

        rows = slurm.sacct([job_id], duplicates=True, timeout=SLURM_QUERY_TIMEOUT_S)
    except Exception as exc:
        log.warning("could not read the earlier attempts of job %s from accounting: %s", job_id, exc)
        return None
    return rows[-2].state if len(rows) >= 2 else None


# --------------------------------------------------------------------------- the start gate (I/O)
def gate_path(run_dir: Path, env) -> Path:
    return Path(run_dir) / "rendezvous" / GATE_NAME.format(key=env.rendezvous_key)


def decide_start(plan, env, run_dir: Path) -> Gate:
    """Rank 0, before the rendezvous: decide, append a missing end line, publish the answer."""
    from lmtrain.callbacks import append_jsonl
    from lmtrain.checkpoint import newest_complete

    policy = Policy.from_plan(plan.preemption)
    run_dir = Path(run_dir)
    history = attempt_rows(read_jsonl(plan.paths.ledger))
    ckpt = newest_complete(plan.paths.checkpoint_dir)
    previous_state = None
    if history and history[-1].reason is None and env.launcher == "slurm" and env.restart_count > 0:
        previous_state = _previous_attempt_state(env.job_id)
    done = run_dir / "DONE"
    try:
        done_text = done.read_text().strip()
    except OSError:
        done_text = ""
    gate = start_gate(StartFacts(
        done_step=int(done_text) if done_text.isdigit() else None,
        done_marker=done.exists(), cancelled_marker=(run_dir / "CANCELLED").exists(),
        start_step=ckpt.step if ckpt is not None else 0, restart_count=env.restart_count, job_id=env.job_id,
        history=history, previous_state=previous_state, max_steps=int(plan.trainer["max_steps"]),
    ), policy)
    if gate.previous_end is not None:
        append_jsonl(plan.paths.ledger, gate.previous_end)
    if not gate.exit and done.exists():
        log.warning("the run finished at step %s before; continuing to trainer.max_steps(%s)",
                    done.read_text().strip(), plan.trainer["max_steps"])
        done.unlink(missing_ok=True)
    path = gate_path(run_dir, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(gate.to_json())
    os.replace(tmp, path)  # before the rendezvous file: a rank that sees that one sees this
    return gate


def read_gate(run_dir: Path, env) -> Gate:
    d = json.loads(gate_path(run_dir, env).read_text())
    return Gate(**d)


def finish_without_training(plan, env, attempt: int, gate: Gate) -> int:
    """An attempt the gate refused: rank 0 writes its start and end lines; every rank exits 0."""
    log.warning("attempt %d ends before training: %s (%s)", attempt, gate.reason, gate.detail)
    try:
        _write_skipped_attempt(plan, env, attempt, gate)
    finally:
        if _EARLY is not None:
            _EARLY.restore()
    return 0


def _write_skipped_attempt(plan, env, attempt: int, gate: Gate) -> None:
    from lmtrain.callbacks import append_jsonl
    from lmtrain.checkpoint import newest_complete

    if env.rank == 0:
        ckpt = newest_complete(plan.paths.checkpoint_dir)
        step = ckpt.step if ckpt is not None else 0
        now = time.time()
        append_jsonl(plan.paths.ledger, {
            "event": "start", "attempt": attempt, "job_id": env.job_id, "restart_count": env.restart_count,
            "time": now, "start_step": step, "nodes": list(env.nodes), "world_size": env.world_size,
        })
        append_jsonl(plan.paths.ledger, {
            "event": "end", "attempt": attempt, "job_id": env.job_id, "time": now, "end_step": step,
            "reason": gate.reason, "detail": gate.detail, "requeued": False, "skipped": True,
        })
        append_jsonl(plan.paths.heartbeat, {"time": now, "event": "end", "step": step, "reason": gate.reason,
                                            "attempt": attempt, "job_id": env.job_id, "world_size": env.world_size})


# --------------------------------------------------------------------------- the agreement callback
import lightning.pytorch as pl  # noqa: E402  (the pure parts above do not need it)


@dataclass
class AgreedStop:
    """What every rank learned from the agreement collective (the same on all ranks)."""

    step: int
    term: bool
    warning: bool
    signal_time: float | None
    checkpoint_path: str | None = None
    checkpoint_done_at: float | None = None


class StopAgreement(pl.Callback):
    """At every optimizer-step boundary: one all-reduce decides whether all ranks stop now.

    Replaces :class:`lmtrain.callbacks.StopAtStepBoundary`; must come after the
    CheckpointCallback (it uses its collective ``save``).
    """

    def __init__(self, controller: Preemption, checkpoints) -> None:
        self.controller = controller
        self.stop = controller.stop
        self.checkpoints = checkpoints
        self._seen_step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step
        # Trainer.fit registered Lightning's SIGTERM handler (composed with ours): take over.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and getattr(connector, "received_sigterm", False):
            connector.received_sigterm = False  # ours, composed in, recorded it: we stop, not Lightning
        self.controller.signals.install()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self.stop.armed or step == self._seen_step:
            return  # mid-accumulation: not a step boundary
        self._seen_step = step
        if step % max(1, self.stop.check_every_n_steps) and step < trainer.max_steps:
            return
        agreed = self._exchange(trainer, pl_module, step)
        if agreed is None:
            return
        if not self.stop.requested:
            self.stop.request("peer", "another rank was asked to stop")
        log.info("stop agreed at step %d (SIGTERM: %s, warning: %s): checkpointing", step, agreed.term, agreed.warning)
        path = self.checkpoints.save(trainer, step)
        agreed.checkpoint_done_at = time.time()
        agreed.checkpoint_path = path or str(self.checkpoints.manager.dir / f"step-{step}")
        self.controller.agreed = agreed
        self.stop.agreed_step = step
        self.stop.checkpoint_path = agreed.checkpoint_path
        trainer.should_stop = True
        if step < trainer.max_steps:
            # Lightning validates once more when should_stop is set (as for early stopping): not
            # on the way out of a preemption, the grace time is for the exit and the requeue.
            trainer.limit_val_batches = 0

    def _exchange(self, trainer, pl_module, step: int) -> AgreedStop | None:
        import torch
        import torch.distributed as dist

        rec = self.controller.signals.record
        first = rec.first_at if rec.first_at is not None else (self.stop.requested_at if self.stop.requested else None)
        flags = torch.tensor(
            [float(self.stop.requested), float(rec.term_at is not None), float(rec.warning_at is not None),
             -first if first is not None else -1e300],
            dtype=torch.float64, device=pl_module.device,
        )
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the one collective per step boundary
        requested, term, warning, neg_first = flags.tolist()
        if requested <= 0:
            return None
        return AgreedStop(step=step, term=term > 0, warning=warning > 0,
                          signal_time=-neg_first if neg_first > -1e299 else None)


# --------------------------------------------------------------------------- the controller
class Preemption:
    """Preemption handling of one attempt (one per task process); wired in by lmtrain.entry."""

    def __init__(self, plan, env, run_dir: Path, stop, attempt: int) -> None:
        self.plan, self.env, self.run_dir, self.stop, self.attempt = plan, env, Path(run_dir), stop, attempt
        self.policy = Policy.from_plan(plan.preemption)
        self.signals = _adopt_early(stop, self.policy.signal) or SignalOwner(stop, self.policy.signal)
        self.agreed: AgreedStop | None = None
        self._action: str | None = None
        stop.armed = True

    def start(self) -> None:
        self.signals.install()

    def callback(self, checkpoints) -> StopAgreement:
        return StopAgreement(self, checkpoints)

    def guard_workers(self, *loaders) -> None:
        guard_dataloader_workers(loaders, self.signals.signums, self.env.rank)

    def decide(self, ctx, outcome) -> None:
        """Every rank: settle the outcome; rank 0 also asks SLURM and applies the loop guards.

        Runs in the entry's ``finally``: a failure here must not cost the ledger ``end`` line, so
        it is logged and the outcome kept as the fit left it (no requeue)."""
        try:
            self._decide(ctx, outcome)
        except Exception as exc:
            log.exception("preemption decision failed; the attempt ends as the fit left it")
            outcome.detail = f"{outcome.detail or outcome.reason}; (preemption decision failed: {exc})"[:2000]
            self._action = None

    def _decide(self, ctx, outcome) -> None:
        from lmtrain.checkpoint import newest_complete

        agreed = self.agreed
        rec = self.signals.record
        term = bool(agreed.term if agreed else rec.term_at is not None)
        warning = bool(agreed.warning if agreed else rec.warning_at is not None)
        signal_time = agreed.signal_time if agreed else rec.first_at
        crashed = outcome.exit_code != 0 or (outcome.reason == "crashed" and agreed is None)
        if agreed is not None:
            outcome.extra["stop_step"] = agreed.step
        if signal_time is not None:
            outcome.extra["signal_time"] = round(signal_time, 3)
            outcome.extra["signal"] = _signal_names(EndFacts(0, 0, 0, None, False, False, term=term,
                                                             warning=warning, warning_name=self.signals.warning_name))
        if agreed is not None and agreed.checkpoint_done_at is not None and signal_time is not None:
            seconds = agreed.checkpoint_done_at - signal_time
            outcome.extra["checkpoint_seconds"] = round(seconds, 3)
            grace = self.plan.preemption.get("grace_seconds")
            if term and grace and seconds > 0.5 * grace and self.env.rank == 0:
                log.warning("SIGTERM to checkpoint complete took %.1f s of the partition's GraceTime of %s s: "
                            "a slower save would be killed (raise GraceTime, or checkpoint less state)",
                            seconds, grace)
        if self.env.rank != 0:
            if outcome.reason != "completed" and agreed is not None and not crashed:
                outcome.reason = "preempted"  # rank 0 writes the real reason; others only exit cleanly
            return

        info = None
        if self.env.launcher == "slurm" and outcome.end_step < int(self.plan.trainer["max_steps"]):
            info = _slurm_job_facts(self.env.job_id)
        ckpt = newest_complete(self.plan.paths.checkpoint_dir)
        history = [a for a in attempt_rows(read_jsonl(self.plan.paths.ledger)) if a.attempt != self.attempt]
        facts = EndFacts(
            end_step=outcome.end_step, start_step=ctx.start_step, max_steps=int(self.plan.trainer["max_steps"]),
            checkpoint_step=ckpt.step if ckpt is not None else None, stopped=agreed is not None, crashed=crashed,
            term=term, warning=warning, warning_name=self.signals.warning_name,
            requested_reason=self.stop.reason if self.stop.requested and not (term or warning) else None,
            error=outcome.detail if crashed else None,
            cancelled_marker=(self.run_dir / "CANCELLED").exists(), launcher=self.env.launcher,
            job_id=self.env.job_id, restart_count=self.env.restart_count,
            slurm_state=_why_completing(self.env, info) or (info or {}).get("JobState"),
            preempting=(info or {}).get("PreemptTime", "None") not in ("None", "", "Unknown"),
            slurm_restarts=int(info["Restarts"]) if info and str(info.get("Restarts", "")).isdigit() else None,
            nodes_down=_nodes_failed(self.env, info) if info is not None else [],
            seconds_left=_seconds_left(info, signal_time) if signal_time is not None else None,
            history=history,
        )
        d = decide(facts, self.policy)
        log.info("attempt %d ends: %s (%s)", self.attempt, d.reason, d.detail)
        outcome.reason, outcome.detail, outcome.requeued = d.reason, d.detail, d.requeued
        outcome.exit_code = max(outcome.exit_code, d.exit_code)
        self._action = d.action

    def after_end(self, ctx, outcome) -> None:
        """Rank 0, LAST (checkpoint complete, ledger and heartbeat written): requeue or cancel."""
        try:
            if self.env.rank != 0 or self._action is None:
                return
            from launcher import slurm

            try:
                if self._action == "requeue":
                    log.info("requeueing job %s (scontrol requeue)", self.env.job_id)
                    slurm.requeue(self.env.job_id, timeout=SLURM_QUERY_TIMEOUT_S)
                elif self._action == "cancel":
                    log.info("cancelling job %s: %s", self.env.job_id, outcome.detail)
                    slurm.cancel([self.env.job_id], timeout=SLURM_QUERY_TIMEOUT_S)
            except Exception as exc:
                from lmtrain.callbacks import append_jsonl

                log.error("%s of job %s failed: %s", self._action, self.env.job_id, exc)
                append_jsonl(self.plan.paths.ledger, {
                    "event": f"{self._action}_failed", "attempt": self.attempt, "job_id": self.env.job_id,
                    "time": time.time(), "detail": str(exc)[:500],
                })
                outcome.exit_code = outcome.exit_code or 1
        finally:
            self.signals.restore()


__all__ = [
    "AgreedStop", "AttemptRow", "Decision", "EndFacts", "Gate", "Policy", "Preemption", "SignalOwner",
    "StartFacts", "StopAgreement", "WorkerSignalGuard", "attempt_rows", "guard_dataloader_workers", "decide", "decide_start", "finish_without_training",
    "read_gate", "read_jsonl", "start_gate", "steps_without_progress",
]
