"""Why an attempt ended and whether the job runs again: pure decisions, no I/O. :func:`start_gate` (before
an attempt trains) and :func:`decide` (after it) take facts the controller (``lmtrain.preemption``) gathered
from the run directory and SLURM, and ``plan.preemption``. docs/run-directory.md lists the ledger reasons."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lmcore.job.plan import PreemptionPlan
from lmcore.run.rundir import LedgerAttempt
from lmcore.slurm.client import state_word
from lmtrain.checkpoint.disk_space import DiskFull
from lmtrain.preemption.spares import InPlace, spare_for

# SLURM states in which the controller already takes care of the job: do not requeue it again.
_SLURM_REQUEUEING = ("PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING", "CONFIGURING")
# The time-limit warning may arrive up to 60 s before warning_seconds; allow that much slack.
WARNING_SLACK_S = 90.0
# docs/run-directory.md: what the ledger's `reason` may say.
LEDGER_REASONS = frozenset({"completed", "preempted", "timeout", "node_failure", "cancelled", "crashed",
                            "no_progress", "limit_reached", "hang", "disk_full", "preflight_failed", "pruned",
                            "straggler"})


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
    requested_reason: str | None = None  # a stop requested without a signal (tests, tools, a search's pruner)
    requested_detail: str | None = None  # what the one who asked for that stop said
    error: str | None = None
    cancelled_marker: bool = False
    launcher: str = "slurm"
    job_id: str = ""
    restart_count: int = 0
    slurm_state: str | None = None  # JobState now; None: not SLURM or SLURM did not answer
    preempting: bool = False  # scontrol shows a PreemptTime: SLURM is preempting (and will requeue) it
    expedited: bool = False  # the job's requeues are expedited (sbatch --requeue=expedite: ExpeditedRequeue=Yes)
    seconds_left: float | None = None  # until the job's time limit, at the signal
    slurm_restarts: int | None = None  # the job's Restarts now: above restart_count = SLURM requeued it already
    nodes_down: list[str] = field(default_factory=list)  # this attempt's nodes that SLURM has DOWN/failed now
    history: list[LedgerAttempt] = field(default_factory=list)  # earlier attempts of the run
    disk_full: dict[str, Any] | None = None  # a stop-time or final checkpoint found no room (DiskFull.figures)
    preflight: dict[str, list[str]] | None = None  # nodes that failed the attempt's preflight -> what failed
    bad_nodes: list[str] = field(default_factory=list)  # nodes this attempt's failure points at (DOWN, hung ranks)
    excluded: list[str] = field(default_factory=list)  # nodes the job already keeps out of (ExcNodeList)
    partition_nodes: list[str] | None = None  # the partition's nodes (None: SLURM did not say)
    job_nodes: int = 1  # how many nodes the job needs
    first_death_node: str | None = None  # the node of the rank that died first in this attempt
    previous_first_death_node: str | None = None  # the same, of the attempt before (in this job)
    spare_nodes: int = 0  # nodes the job holds beyond the ranks' (resources.spare_nodes)
    allocation_nodes: list[str] | None = None  # the job's nodes now (a failed one leaves them); None: unknown
    left_out: list[str] = field(default_factory=list)  # nodes this job's earlier restarts in place left out
    slow_node: str | None = None  # the straggler's node this attempt stopped to leave out (action exclude)
    attempt_nodes: list[str] = field(default_factory=list)  # the nodes this attempt's ranks ran on
    node_groups: dict[str, str] = field(default_factory=dict)  # node -> its switch or block (a plan with a placement)
    unit_nodes: int = 1  # nodes one model-parallel group (tensor x pipeline) spans
    segment: int | None = None  # sbatch --segment: the job's nodes in segments of this many, each in one block
    batch_killed: str | None = None  # SLURM ended the job as its batch script was SIGKILLed (lost_batch_host.batch_killed)


@dataclass
class Decision:
    reason: str
    detail: str
    requeued: bool  # the job will run again (by SLURM or by us)
    action: str | None = None  # "requeue" | "cancel" | None: what rank 0 does LAST
    exit_code: int = 0
    exclude: list[str] = field(default_factory=list)  # nodes to keep the requeued job off (ExcNodeList)
    leave_out: list[str] = field(default_factory=list)  # a restart in place: the nodes its ranks leave out (srun --exclude)
    hold_back: list[str] = field(default_factory=list)  # a restart in place: healthy spares kept idle (srun --exclude too)


def signal_names(warning_name: str, *, warning: bool, term: bool) -> str:
    """The signals an attempt got, as the ledger's ``signal`` says them ("SIGUSR2 + SIGTERM")."""
    names = [n for n, seen in ((warning_name, warning), ("SIGTERM", term)) if seen]
    return " + ".join(names)


def _signals_of(f: EndFacts) -> str:
    return signal_names(f.warning_name, warning=f.warning, term=f.term)


def classify_stop(f: EndFacts, policy: PreemptionPlan) -> tuple[str, str]:
    """(reason, why) of a stop: timeout, preempted, or a requested reason."""
    state = state_word(f.slurm_state)
    left = f.seconds_left
    near_limit = left is not None and left <= policy.warning_seconds + WARNING_SLACK_S
    sigs = _signals_of(f)
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
    if reason in ("pruned", "straggler") and f.requested_detail:
        return reason, f.requested_detail
    return reason, f"stop requested ({f.requested_reason})" if f.requested_reason else "stop requested"


def decide(f: EndFacts, policy: PreemptionPlan) -> Decision:
    """Why the attempt ended, and whether (and by whom) the job runs again."""
    state = state_word(f.slurm_state)
    ckpt = f"checkpoint step-{f.checkpoint_step} complete" if f.checkpoint_step is not None else "no checkpoint"
    if f.end_step >= f.max_steps and not f.crashed:
        return Decision("completed", f"reached max_steps({f.max_steps})", requeued=False)
    if f.cancelled_marker or state == "CANCELLED":
        why = "CANCELLED marker in the run directory" if f.cancelled_marker else "JobState CANCELLED"
        sig = _signals_of(f)
        return Decision("cancelled", f"{why}{'; ' + sig if sig else ''}; {ckpt}; never requeued", requeued=False)

    if f.disk_full is not None:
        return _disk_full(f, state, ckpt)
    if f.preflight is not None:
        return _preflight_failed(f, state, policy)
    reason, detail = _why_it_ended(f, policy, ckpt)
    exit_code = 1 if reason == "crashed" else 0
    slurm_requeues = state in _SLURM_REQUEUEING or (
        f.slurm_restarts is not None and f.slurm_restarts > f.restart_count)
    if reason == "pruned":
        # a search's study stopped this trial (lmtrain.observe.trial_report): a clean end, its
        # checkpoint kept; a job SLURM requeues anyway (a preemption at the same moment) is cancelled
        return Decision("pruned", f"{detail}; never requeued", requeued=False,
                        action="cancel" if f.launcher == "slurm" and slurm_requeues else None)

    # In the partition's GraceTime a preempted job shows RUNNING with a PreemptTime; it requeues itself: slurm
    # 22.05 ends a preempted job whose tasks exit within GraceTime as COMPLETED, never requeued (seen here).
    if f.launcher != "slurm":
        return Decision(reason, detail + "; local run: not requeued", requeued=False, exit_code=exit_code)
    if state == "COMPLETING" and not slurm_requeues and reason != "timeout" and not f.batch_killed:
        # SLURM is tearing the job down and accounting did not say why (scancel shows COMPLETING,
        # not CANCELLED, while the tasks run): a requeue could undo a user's cancel.
        return Decision(reason, detail + "; JobState COMPLETING and accounting did not say why (a bare scancel?): "
                        "not requeued", requeued=False, exit_code=exit_code)

    stop_why, stop_reason = loop_guard(f, reason, policy)
    if stop_why is not None:
        detail = f"{reason}: {detail}; {stop_why}; not requeued"
        # SLURM requeues a preempted job by itself: cancel it so it does not start again.
        return Decision(stop_reason, detail, requeued=False, action="cancel" if slurm_requeues else None,
                        exit_code=exit_code)

    retried = reason in ("crashed", "hang", "straggler") or (reason == "node_failure" and f.spare_nodes > 0)
    if retried and not slurm_requeues and policy.restart_in_place and not f.batch_killed:  # no script to restart
        place = in_place(f, policy)
        if place.refused is None:
            swap = f"; {place.why}" if place.why else ""
            where = "the same job" if place.why else "the same job and nodes"
            return Decision(reason, detail + f"{swap}; restarted in place ({where}, no queue wait)",
                            requeued=True, action="restart", exit_code=exit_code, leave_out=place.leave_out,
                            hold_back=place.hold_back)
        detail += f"; not restarted in place: {place.refused}"
    return _requeued(f, reason, detail, state, slurm_requeues=slurm_requeues, exit_code=exit_code)


def _requeued(f: EndFacts, reason: str, detail: str, state: str, *, slurm_requeues: bool, exit_code: int) -> Decision:
    """The job runs again by a requeue: SLURM's own (a preemption, a node failure) or ours, with the
    nodes a node failure or a hang points at kept out where SLURM lets them be."""
    exclude, why_not = nodes_to_exclude(f, own_requeue=not slurm_requeues) if reason in ("node_failure", "hang") \
        else ([], "")
    if exclude:
        new = [n for n in exclude if n not in f.excluded]
        detail += f"; {', '.join(new)} kept out of the requeued job (ExcNodeList={','.join(exclude)})"
    elif why_not:
        detail += f"; {why_not}"
    if f.expedited:  # SlurmctldParameters=enable_expedited_requeue: no requeue_delay, the top of the queue
        detail += "; an expedited requeue: eligible again at once, at the top of the queue"
    if slurm_requeues:
        return Decision(reason, detail + f"; requeued by SLURM (JobState {state})", requeued=True, exit_code=exit_code,
                        exclude=exclude)
    by = " during the preemption's GraceTime (PreemptTime set)" if f.preempting else ""
    return Decision(reason, detail + f"; requeued (scontrol requeue{by})", requeued=True, action="requeue",
                    exit_code=exit_code, exclude=exclude)


# a restart in place needs this much of the allocation left, beyond the time-limit warning: the
# ranks' start (imports, rendezvous, restore) and some steps to a checkpoint
IN_PLACE_MIN_S = 120.0


def in_place(f: EndFacts, policy: PreemptionPlan) -> InPlace:
    """Whether a crash, a hang or a failed node is retried in this allocation, and on which nodes
    (lmtrain.preemption.spares: a suspect node is left out where a spare takes its place)."""
    needed = IN_PLACE_MIN_S + policy.warning_seconds
    if f.seconds_left is not None and f.seconds_left < needed:
        return InPlace(refused=f"{f.seconds_left:.0f} s left in the allocation, under the {needed:.0f} s a restart "
                               f"needs (start, then steps to a checkpoint before the time-limit warning)")
    return spare_for(f)


def _disk_full(f: EndFacts, state: str, ckpt: str) -> Decision:
    """Not a crash and not worth a retry: the next attempt would meet the same wall. SLURM
    requeues a preempted job by itself, so it is cancelled; the user frees room and resumes."""
    full = DiskFull.from_figures(f.disk_full or {})
    resume = "lmlaunch submit --resume" if f.launcher == "slurm" else "lmlaunch run --local --resume"
    detail = (f"{full}; {ckpt} (the resume point); free room in {full.directory} (or lower "
              f"checkpoint.keep_last), then `{resume}`; not requeued")
    requeueing = state in _SLURM_REQUEUEING or (f.slurm_restarts is not None and f.slurm_restarts > f.restart_count)
    return Decision("disk_full", detail, requeued=False,
                    action="cancel" if f.launcher == "slurm" and requeueing else None, exit_code=1)


def _why_it_ended(f: EndFacts, policy: PreemptionPlan, ckpt: str) -> tuple[str, str]:
    """(reason, detail) of an attempt that did not complete: a node SLURM set DOWN, a stop, or a crash."""
    if f.nodes_down:
        # SLURM set a node of this job DOWN: it kills the steps (SIGTERM when the node's slurmd
        # still answers) and requeues the job itself (NODE_FAIL in accounting).
        why = f"node {', '.join(f.nodes_down)} DOWN" + (f" ({_signals_of(f)})" if f.warning or f.term else "")
        return "node_failure", f"{why}; {ckpt}"
    if f.batch_killed:  # the ranks' SIGTERM is SLURM ending the job: a crash of its batch script, requeued
        return "crashed", f"the job's batch script was killed ({f.batch_killed}): SLURM ended the job; {ckpt}"
    if f.warning or f.term or (f.stopped and not f.crashed):
        reason, why = classify_stop(f, policy)
        return reason, f"{why}; {ckpt}" + (f"; then {f.error}" if f.crashed and f.error else "")
    detail = f.error or "the Trainer stopped before max_steps without a stop request"
    return "crashed", detail + (f"; resumes from {ckpt}" if f.checkpoint_step is not None else "")


def loop_guard(f: EndFacts, reason: str, policy: PreemptionPlan) -> tuple[str | None, str]:
    """(why the job must not run again, the ledger reason then), or (None, ""): the crash
    retries, the requeues, the time limits and the attempts without progress."""
    job_hist = [a for a in f.history if a.job_id == f.job_id]
    if reason == "crashed":
        retries = sum(1 for a in job_hist if a.reason in ("crashed", "hang") and a.requeued)  # a hang retries as a crash
        if retries >= policy.max_crash_retries:
            return f"max_crash_retries({policy.max_crash_retries}) reached", "crashed"
    if f.restart_count >= policy.max_requeues:
        return f"max_requeues({policy.max_requeues}) reached ({f.restart_count} requeues)", "limit_reached"
    if reason == "timeout":
        timeouts = 1 + sum(1 for a in job_hist if a.reason == "timeout")
        if timeouts > policy.max_timeouts:
            return f"max_timeouts({policy.max_timeouts}) reached ({timeouts} time limits)", "limit_reached"
    starts = [a.start_step for a in f.history if not a.skipped] + [f.start_step]
    current = f.checkpoint_step if f.checkpoint_step is not None else f.start_step
    stuck = steps_without_progress(starts, current)
    if stuck >= policy.no_progress_attempts:
        return (f"the global step stayed at {current} over {stuck} attempts "
                f"(no_progress_attempts={policy.no_progress_attempts})"), "no_progress"
    return None, ""


def _preflight_failed(f: EndFacts, state: str, policy: PreemptionPlan) -> Decision:
    """Nodes failed the attempt's checks: one more attempt (off those nodes where SLURM lets the
    job be changed) tells a bad node from a bad setup; a second failure stops the job with what
    failed, as does every node failing (a setup every node shares)."""
    detail = "preflight failed on " + "; ".join(f"{n}: {', '.join(m)}" for n, m in sorted((f.preflight or {}).items()))
    slurm_requeues = state in _SLURM_REQUEUEING
    again = any(a.reason == "preflight_failed" for a in f.history if a.job_id == f.job_id)
    if f.launcher == "slurm" and f.bad_nodes and not again and f.restart_count < policy.max_requeues:
        exclude, why_not = nodes_to_exclude(f, own_requeue=not slurm_requeues)
        where = (f"{', '.join(n for n in exclude if n not in f.excluded)} kept out of the requeued job "
                 f"(ExcNodeList={','.join(exclude)})") if exclude else why_not
        return Decision("preflight_failed", f"{detail}; {where}; requeued once", requeued=True,
                        action=None if slurm_requeues else "requeue", exit_code=1, exclude=exclude)
    why = ("a local run" if f.launcher != "slurm" else "every node failed: the setup, not a node"
           if not f.bad_nodes else "it failed in the attempt before too" if again
           else f"max_requeues({policy.max_requeues}) reached")
    return Decision("preflight_failed", f"{detail}; {why}: fix it, then resume; not requeued", requeued=False,
                    action="cancel" if f.launcher == "slurm" and slurm_requeues else None, exit_code=1)


def nodes_to_exclude(f: EndFacts, *, own_requeue: bool = False) -> tuple[list[str], str]:
    """The nodes a requeue after a node failure or a hang keeps out of, and why none when none:
    only nodes the failure points at, never so many that the job no longer fits the partition,
    and only when SLURM requeues the job itself: ExcNodeList changes only while a job is pending,
    and a job that requeues itself is pending only once its own processes are gone."""
    bad = sorted(set(f.bad_nodes) - set(f.excluded))
    if not bad:
        return [], ""
    if own_requeue:
        return [], (f"{', '.join(bad)} not excluded: SLURM changes ExcNodeList only while a job is pending, "
                    f"and this job requeues itself (`lmlaunch doctor SPEC --on-nodes --exclude-bad` keeps "
                    f"bad nodes out of the next submission)")
    if f.partition_nodes is None:
        return [], f"{', '.join(bad)} not excluded: the partition's nodes are unknown"
    left = set(f.partition_nodes) - set(f.excluded) - set(bad)
    if len(left) < f.job_nodes:
        return [], (f"{', '.join(bad)} not excluded: the partition would keep {len(left)} node(s) for a job "
                    f"of {f.job_nodes}")
    if f.segment and f.node_groups:
        room = segments_left(left, f.node_groups, f.segment)
        needed = -(-(f.job_nodes + f.spare_nodes) // f.segment)
        if room < needed:
            return [], (f"{', '.join(bad)} not excluded: without it the blocks hold {room} whole segment(s) of "
                        f"{f.segment} node(s), the job needs {needed} (resources.placement); SLURM would never start it")
    return sorted(set(f.excluded) | set(bad)), ""


def segments_left(nodes: set[str], groups: dict[str, str], segment: int) -> int:
    """How many segments of ``segment`` nodes the blocks can still hold of ``nodes`` (SLURM puts
    each segment inside one block)."""
    per: dict[str, int] = {}
    for n in nodes:
        if groups.get(n) is not None:
            per[groups[n]] = per.get(groups[n], 0) + 1
    return sum(k // segment for k in per.values())


@dataclass
class StartFacts:
    done_marker: bool
    cancelled_marker: bool
    start_step: int  # newest complete checkpoint
    restart_count: int
    job_id: str
    history: list[LedgerAttempt]
    previous_state: str | None = None  # SLURM's state of the previous attempt (sacct -D), if known
    max_steps: int | None = None  # the plan's trainer.max_steps (None: a DONE marker is final)
    done_step: int | None = None  # the step the DONE marker records (None: unknown, final)
    undecided_exit: str | None = None  # the batch script restarted the ranks: srun's exit, rank 0 never decided


@dataclass
class Gate:
    """The start gate's answer: ``exit`` -> end this attempt at once with ``reason``."""

    exit: bool
    reason: str | None = None
    detail: str | None = None
    previous_end: dict[str, Any] | None = None  # lmtrain.observe.attempt.MissingEnd's fields: an earlier attempt's end

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


# SLURM's word for an attempt without an end line -> its reason. REQUEUED: SLURM took the allocation
# back (a preemption, `scontrol requeue`) while a killed rank 0 was being restarted: not a node failure.
_PREVIOUS_REASONS = {"NODE_FAIL": "node_failure", "PREEMPTED": "preempted", "REQUEUED": "preempted", "REQUEUE_HOLD":
                     "preempted", "TIMEOUT": "timeout", "CANCELLED": "cancelled", "OUT_OF_MEMORY": "crashed", "FAILED": "crashed"}


def start_gate(f: StartFacts, policy: PreemptionPlan) -> Gate:
    """Before training: record an earlier attempt that never wrote its end, and refuse to train a
    run that is finished, cancelled or over a loop guard."""
    previous_end = None
    if f.history and f.history[-1].reason is None:
        prev = f.history[-1]
        reason = _PREVIOUS_REASONS.get(state_word(f.previous_state), "node_failure")
        seen = f"SLURM: {state_word(f.previous_state)}" if f.previous_state else "node failure, SIGKILL?"
        previous_end = {
            "attempt": prev.attempt, "job_id": prev.job_id, "end_step": f.start_step, "reason": reason,
            "detail": (f"attempt {prev.attempt} has no end line: its tasks were killed without a chance to "
                       f"write it ({seen}); recorded at the start of the next attempt, "
                       f"which resumes from step {f.start_step}"),
        }
        if f.undecided_exit:  # the batch script's loop (launcher.submit.script): srun failed and rank 0 never said what next
            reason = "crashed"
            previous_end.update(reason=reason, restart="in_place", detail=(
                f"attempt {prev.attempt} has no end line: rank 0's process ended before it decided (srun exited "
                f"{f.undecided_exit}: killed, by SIGKILL or the OOM killer?); the batch script restarted the ranks "
                f"in place (the same job, no queue wait), which resume from step {f.start_step}"))
        prev.reason, prev.end_step, prev.requeued = reason, f.start_step, True
    if f.done_marker and (f.max_steps is None or f.done_step is None or f.done_step >= f.max_steps):
        return Gate(True, "completed", "the run already finished (DONE marker): not training again", previous_end)
    # DONE at a step below max_steps: the run was continued to a larger
    # trainer.max_steps (submit --resume trainer.max_steps=N); it trains on.
    if f.cancelled_marker:
        return Gate(True, "cancelled", "the run is cancelled (CANCELLED marker): not training again", previous_end)
    if f.history and f.history[-1].reason == "pruned":
        return Gate(True, "pruned", "the search pruned this trial: not training again", previous_end)
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
