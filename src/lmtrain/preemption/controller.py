"""One attempt's preemption handling (one controller per task process, wired in by
:mod:`lmtrain.task.entry`): it owns the signals and the stop request, hands the Trainer the stop
agreement, decides how the attempt ended (:meth:`Preemption.settle`, the one place) and, LAST,
requeues or cancels the job (:meth:`Preemption.after_end`)."""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

from lmcore.job.plan import PreemptionPlan
from lmcore.run.checkpoint_index import newest_complete
from lmcore.run.lost_batch_host import batch_killed
from lmcore.run.rundir import Ledger, LedgerNote, RunLayout, is_cancelled, left_out_of
from lmcore.slurm import client as slurm
from lmtrain.checkpoint.disk_space import disk_full_in
from lmtrain.health.preflight import PreflightFailed
from lmtrain.health.watchdog import hang_reason
from lmtrain.observe.attempt import AttemptRecords, Outcome
from lmtrain.preemption.bad_nodes import bad_node_facts, exclude_nodes
from lmtrain.preemption.first_death import describe, find_first_death, log_size
from lmtrain.preemption.policy import EndFacts, decide, signal_names
from lmtrain.preemption.signals import SignalOwner, StopRequest, adopt_early, guard_dataloader_workers
from lmtrain.preemption.slurm_facts import (
    SLURM_QUERY_TIMEOUT_S,
    held_nodes,
    job_facts,
    nodes_failed,
    seconds_left,
    why_completing,
)
from lmtrain.preemption.stop_flags import AgreedStop

log = logging.getLogger("lmtrain.preemption")


class Preemption:
    """Preemption handling of one attempt (one per task process); wired in by lmtrain.task.entry."""

    def __init__(self, plan: Any, env: Any, attempt: int) -> None:
        self.plan, self.env, self.attempt = plan, env, attempt
        self.layout = RunLayout.of_plan(plan)
        self.policy: PreemptionPlan = plan.preemption
        self.stop = StopRequest()
        self.signals = adopt_early(self.stop, self.policy.signal) or SignalOwner(self.stop, self.policy.signal)
        self.agreed: AgreedStop | None = None
        self.stop.armed = True
        self.checkpoints: Any = None  # the checkpoint callback (set by :meth:`callback`): its bucket's last upload
        self.slow_node: str | None = None  # a straggler's node this attempt stops to leave out
        self.stop.check_every_n_steps = self.policy.agree_every_n_steps
        # srun's task lines of this attempt (lmtrain.preemption.first_death) start at the log's size now
        self._srun_log = plan.slurm.error.replace("%j", env.job_id) if env.launcher == "slurm" else None
        self._srun_offset = log_size(self._srun_log) if env.rank == 0 else 0

    def start(self) -> None:
        self.signals.install()

    def leave_slow_node(self, node: str, why: str, idle_spares: list[str] | None) -> None:
        """Rank 0, from the straggler watch (health.stragglers.action exclude): stop at the next step
        boundary, checkpointed, so that the ranks restart in place without ``node`` and a spare takes
        its place; once per attempt, and only while a spare is idle (never below the job's nodes)."""
        if self.slow_node is not None or not node or node == "?" or self.stop.requested:
            return
        if not idle_spares:
            log.warning("straggler: %s stays in the job: no spare node is idle to take its place", node)
            return
        self.slow_node = node
        log.warning("straggler: stopping at the next step boundary to leave %s out (spare %s takes its place)",
                    node, idle_spares[0])
        self.stop.request("straggler", f"{why}; {node} left out for a spare (health.stragglers.action exclude)")

    def callback(self, checkpoints: Any) -> Any:
        """The Lightning callback that agrees the stop (lmtrain.preemption.agreement, the package's
        one Lightning import, made here: the scale harness's ranks import no Lightning)."""
        from lmtrain.preemption.agreement import StopAgreement

        self.checkpoints = checkpoints
        return StopAgreement(self, checkpoints)

    def guard_workers(self, *loaders: Any) -> None:
        guard_dataloader_workers(loaders, self.signals.signums, self.env.rank)

    def failed(self, exc: BaseException, step: int, records: AttemptRecords) -> Outcome:
        """The outcome of an attempt whose training raised ``exc`` at ``step``: a diagnosis
        (a failed preflight, a full disk: the figures go to the ledger, the policy decides), or a
        crash, which this rank's last words report and which is raised again once the records are
        written."""
        outcome = Outcome(
            reason=self.stop.reason or hang_reason(exc, self.layout, self.attempt) or "crashed",
            end_step=step, detail=f"{type(exc).__name__}: {exc}"[:2000], exit_code=1,
        )
        full = disk_full_in(exc)
        if isinstance(exc, PreflightFailed):
            outcome.reason, outcome.extra["preflight"] = "preflight_failed", exc.failed
            log.error("%s", exc)
        elif full is not None:
            outcome.extra["disk_full"] = full.figures
            log.error("training stopped: %s", full)
        else:
            log.error("training failed:\n%s", traceback.format_exc())
            records.last_words(exc)
            outcome.error = exc
        return outcome

    def settle(self, outcome: Outcome, start_step: int) -> Outcome:
        """Every rank, the one place an attempt's outcome is decided: the reason, and for rank 0
        what SLURM says, the loop guards and whether the job runs again.

        Runs before the ledger's ``end`` line: a failure here must not cost that line, so it is
        logged and the outcome kept as the fit left it (no requeue)."""
        hung = outcome.reason == "hang"  # lmtrain.health.watchdog: a rank of this attempt stopped making progress
        try:
            self._decide(outcome, start_step)
        except Exception as exc:
            log.exception("preemption decision failed; the attempt ends as the fit left it")
            outcome.detail = f"{outcome.detail or outcome.reason}; (preemption decision failed: {exc})"[:2000]
            outcome.action, outcome.exclude = None, []
        if hung and outcome.reason == "crashed":
            outcome.reason = "hang"  # same retry rules as a crash; the ledger says why
        return outcome

    def _decide(self, outcome: Outcome, start_step: int) -> None:
        agreed, rec = self.agreed, self.signals.record
        term = bool(agreed.term if agreed else rec.term_at is not None)
        warning = bool(agreed.warning if agreed else rec.warning_at is not None)
        signal_time = agreed.signal_time if agreed else rec.first_at
        crashed = outcome.exit_code != 0 or (outcome.reason == "crashed" and agreed is None)
        self._stop_figures(outcome, term=term, warning=warning, signal_time=signal_time)
        if self.env.rank != 0:
            if outcome.reason != "completed" and agreed is not None and not crashed:
                outcome.reason = "preempted"  # rank 0 writes the real reason; others only exit cleanly
            return
        if crashed and outcome.reason == "crashed":
            self._blame_first_death(outcome)
        info = None
        if self.env.launcher == "slurm" and outcome.end_step < self.plan.trainer.max_steps:
            info = job_facts(self.env.job_id)
        facts = self._end_facts(outcome, start_step, info, crashed=crashed, term=term, warning=warning,
                                signal_time=signal_time)
        if self.env.launcher == "slurm" and (facts.nodes_down or outcome.reason in ("hang", "preflight_failed")):
            bad_node_facts(self.plan, self.env, self.attempt, facts, info, hung=outcome.reason == "hang")
        d = decide(facts, self.policy)
        log.info("attempt %d ends: %s (%s)", self.attempt, d.reason, d.detail)
        outcome.reason, outcome.detail, outcome.requeued = d.reason, d.detail, d.requeued
        outcome.exit_code = max(outcome.exit_code, d.exit_code)
        outcome.action, outcome.exclude = d.action, d.exclude
        if d.action == "restart":  # the ledger says so: status ("restarting in place"), history (how long it took)
            outcome.extra["restart"] = "in_place"
            if d.leave_out or facts.spare_nodes:  # the nodes the ranks leave out from now on (srun --exclude)
                outcome.extra["left_out"] = d.leave_out
            if d.hold_back:  # healthy spares kept idle so that the ranks keep their switch or block
                outcome.extra["held_back"] = d.hold_back
        if d.action is None and d.exclude and slurm.state_word(facts.slurm_state or "") == "PENDING":
            # SLURM requeued the job itself (a node failure): exclude now, before the end line. The
            # failed node's slurmd kills this rank within seconds, before after_end would run.
            exclude_nodes(self.plan, self.env, self.attempt, d.exclude)
            outcome.exclude = []

    def _stop_figures(self, outcome: Outcome, *, term: bool, warning: bool, signal_time: float | None) -> None:
        """The ledger's figures of a stop: its step, the signals, the seconds to a complete checkpoint."""
        agreed = self.agreed
        if agreed is not None:
            outcome.extra["stop_step"] = agreed.step
            if agreed.checkpoint_held_s is not None:  # the stop's save held training (its staging)
                outcome.extra["checkpoint_held_s"] = round(agreed.checkpoint_held_s, 3)
        mirror = getattr(getattr(self.checkpoints, "manager", None), "mirror", None)  # rank 0, checkpoint.dir s3://
        if mirror is not None and (fate := mirror.fate()) is not None:
            outcome.extra["bucket"] = fate  # its newest checkpoint in the bucket, or why not
        if signal_time is not None:
            outcome.extra["signal_time"] = round(signal_time, 3)
            outcome.extra["signal"] = signal_names(self.signals.warning_name, warning=warning, term=term)
        if agreed is not None and agreed.checkpoint_done_at is not None and signal_time is not None:
            seconds = agreed.checkpoint_done_at - signal_time
            outcome.extra["checkpoint_seconds"] = round(seconds, 3)
            grace = self.plan.preemption.grace_seconds
            if term and grace and seconds > 0.5 * grace and self.env.rank == 0:
                log.warning("SIGTERM to checkpoint complete took %.1f s of the partition's GraceTime of %s s: "
                            "a slower save would be killed (raise GraceTime, or checkpoint less state)",
                            seconds, grace)

    def _end_facts(self, outcome: Outcome, start_step: int, info: dict[str, str] | None, *, crashed: bool,
                   term: bool, warning: bool, signal_time: float | None) -> EndFacts:
        """Rank 0: what the run directory and SLURM say now, for the policy."""
        ckpt = newest_complete(self.plan.paths.checkpoint_dir)
        history = [a for a in Ledger(self.plan.paths.ledger).attempts() if a.attempt != self.attempt]
        restarts = str((info or {}).get("Restarts", ""))
        return EndFacts(
            end_step=outcome.end_step, start_step=start_step, max_steps=self.plan.trainer.max_steps,
            checkpoint_step=ckpt.step if ckpt is not None else None, stopped=self.agreed is not None,
            crashed=crashed, term=term, warning=warning, warning_name=self.signals.warning_name,
            requested_reason=self.stop.reason if self.stop.requested and not (term or warning) else None,
            requested_detail=self.stop.detail if self.stop.requested and not (term or warning) else None,
            error=outcome.detail if crashed else None,
            cancelled_marker=is_cancelled(self.layout.run_dir), launcher=self.env.launcher,
            job_id=self.env.job_id, restart_count=self.env.restart_count,
            slurm_state=why_completing(self.env, info) or (info or {}).get("JobState"),
            preempting=(info or {}).get("PreemptTime", "None") not in ("None", "", "Unknown"),
            expedited=(info or {}).get("ExpeditedRequeue") == "Yes",  # scontrol show job, SLURM 26.05
            slurm_restarts=int(restarts) if restarts.isdigit() else None, batch_killed=batch_killed(info or {}),
            nodes_down=nodes_failed(self.env, info) if info is not None else [],
            seconds_left=seconds_left(info, signal_time if signal_time is not None else time.time())
            if info is not None else None,
            history=history, disk_full=outcome.extra.get("disk_full"), job_nodes=self.plan.topology.nodes,
            preflight=outcome.extra.get("preflight"),
            first_death_node=(outcome.extra.get("first_death") or {}).get("node"),
            previous_first_death_node=self._previous_first_death_node(),
            spare_nodes=getattr(self.plan.slurm, "spare_nodes", 0),
            allocation_nodes=held_nodes(info) if info is not None else None,
            left_out=left_out_of(self._this_jobs_ends(), self.env.job_id),
            slow_node=self.slow_node, **self._network_facts(),
        )

    def _network_facts(self) -> dict[str, Any]:
        """The attempt's nodes and, with a placement, every allocation node's switch or block."""
        placement = getattr(self.plan, "placement", None) or {}
        groups = placement.get("groups") or {}
        from lmcore.job.network import groups_by_node

        return {"attempt_nodes": list(self.env.nodes),
                "node_groups": groups_by_node(groups),
                "unit_nodes": int(placement.get("group_nodes") or 1), "segment": placement.get("segment")}

    def _this_jobs_ends(self) -> list[dict[str, Any]]:
        """The end lines of this job's earlier attempts (restarts in place), oldest first."""
        from lmcore.jsonlines import read_jsonl

        return [e for e in read_jsonl(self.layout.ledger) if e.get("event") == "end"
                and str(e.get("job_id")) == str(self.env.job_id) and e.get("attempt") != self.attempt]

    def _previous_first_death_node(self) -> str | None:
        """The node whose rank died first in this job's attempt before this one (restarts in place)."""
        ends = self._this_jobs_ends()
        death = ends[-1].get("first_death") if ends else None
        return death.get("node") if isinstance(death, dict) else None

    def _blame_first_death(self, outcome: Outcome) -> None:
        """Rank 0: name the rank that died first (lmtrain.preemption.first_death), not this rank's symptom."""
        env, per_node = self.env, max(1, self.plan.topology.tasks_per_node)
        node_of = {r: env.nodes[0] if env.launcher == "local" else
                   env.nodes[r // per_node] if r // per_node < len(env.nodes) else "?" for r in range(env.world_size)}
        death = find_first_death(self.layout.run_dir, self.attempt, world_size=env.world_size, me=env.rank,
                                 node_of=node_of, srun_log=self._srun_log, srun_offset=self._srun_offset)
        if death is None:
            return
        outcome.extra["first_death"] = death
        if death["rank"] != env.rank:  # else the detail already is this rank's own error
            outcome.detail = f"{describe(death)}; rank {env.rank} saw: {outcome.detail}"[:2000]
            log.error("%s", describe(death))

    def hang_ended(self, records: AttemptRecords, start_step: int, report: Any) -> None:
        """Rank 0's own watchdog fired (lmtrain.health.watchdog; its main thread is stuck): the
        attempt's end as :func:`lmtrain.task.training` ends one, decided by the same policy, so
        that a hang restarts in place (or requeues) before the watchdog ends the process."""
        from lmtrain.health.watchdog import EXIT_HANG

        outcome = Outcome(reason="hang", end_step=report.step, detail=report.detail(), exit_code=EXIT_HANG)
        outcome = self.settle(outcome, start_step)
        records.end_line(outcome, at=report.time)
        records.heartbeat.emit("end", step=outcome.end_step, reason=outcome.reason)
        self.after_end(outcome)

    def tell_batch_script(self, decision: str, leave_out: list[str]) -> None:
        """Rank 0 of a job that restarts in place, before it acts: what it decided (``restart``,
        ``requeue``, ``cancel``, ``none``), for the batch script's loop (launcher.submit.script), which
        restarts the ranks on ``restart`` and, when srun failed with no decision at all, because
        rank 0 was killed before this. Its first line names this job (an array task's own id)."""
        if self.env.rank != 0 or self.env.launcher != "slurm" or not self.policy.restart_in_place:
            return
        from lmcore.atomic import write_atomic

        job = os.environ.get("SLURM_JOB_ID", self.env.job_id)
        try:
            write_atomic(self.layout.restart_request, f"{job}\n{','.join(leave_out)}\n{decision}\n")
        except OSError as exc:  # the batch script then restarts as if rank 0 had died: bounded, said
            log.error("could not tell the batch script this attempt's decision (%s): %s", decision, exc)

    def after_end(self, outcome: Outcome) -> None:
        """Rank 0, LAST (checkpoint complete, ledger and heartbeat written): requeue or cancel."""
        try:
            if self.env.rank != 0:
                return
            if outcome.action is None:
                self.tell_batch_script("none", [])
                exclude_nodes(self.plan, self.env, self.attempt, outcome.exclude)  # SLURM requeued it itself
                return
            self.tell_batch_script(outcome.action, [*(outcome.extra.get("left_out") or []),
                                                    *(outcome.extra.get("held_back") or [])])
            try:
                if outcome.action == "restart":  # the batch script starts the ranks again (launcher.submit.script)
                    log.info("asking the batch script to restart the ranks in place (job %s)", self.env.job_id)
                elif outcome.action == "requeue":
                    log.info("requeueing job %s (scontrol requeue)", self.env.job_id)
                    slurm.requeue(self.env.job_id, timeout=SLURM_QUERY_TIMEOUT_S)
                    exclude_nodes(self.plan, self.env, self.attempt, outcome.exclude)
                elif outcome.action == "cancel":
                    log.info("cancelling job %s: %s", self.env.job_id, outcome.detail)
                    slurm.cancel([self.env.job_id], timeout=SLURM_QUERY_TIMEOUT_S)
            except Exception as exc:
                log.error("%s of job %s failed: %s", outcome.action, self.env.job_id, exc)
                Ledger(self.plan.paths.ledger).write(LedgerNote(
                    event=f"{outcome.action}_failed", time=time.time(),
                    fields={"attempt": self.attempt, "job_id": self.env.job_id, "detail": str(exc)[:500]},
                ))
                outcome.exit_code = outcome.exit_code or 1
        finally:
            self.signals.restore()
            if self.env.launcher == "slurm":  # a task's process: it only exits from here on
                from lmtrain.preemption.signals import retire

                retire()  # a time-limit warning now (up to a minute early) must not kill it as it exits


def end_attempt(ctl: Preemption, records: AttemptRecords, startup: Any, outcome: Outcome) -> int:
    """The attempt's records, its messages delivered (a bounded wait), then (LAST) the requeue or
    cancel, which gives the signal handlers back; the fit's error raised again. ``startup``: the
    attempt's lmtrain.observe.callbacks.StartupRecord (None: the scale harness's ranks, which have none)."""
    first = records.ended(outcome)
    if startup is not None and records.writer and not startup.written:  # ended before its first step: the phases it reached
        startup.write()
    records.close()  # while lmtrain's handlers still only record: a late signal cannot cut a message
    if first:  # else rank 0's hang watchdog ended this attempt and already asked for what follows
        ctl.after_end(outcome)  # scontrol requeue comes LAST
    else:
        ctl.signals.restore()
    if outcome.error is not None:
        raise outcome.error
    return outcome.exit_code
