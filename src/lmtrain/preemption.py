"""Preemption, time limits and requeue: one owner of signals, a stop agreed at a step boundary,
a complete checkpoint, then one decision (rank 0) about why the attempt ended and whether the
job requeues itself.

The path of a stop (docs/run-directory.md for the ledger):

1. :class:`lmtrain.signals.SignalOwner` installs handlers for the warning signal (``plan.preemption.signal``,
   USR2 by default) and SIGTERM in the training process only. They are installed when the
   task starts and installed again in ``on_train_start``, after Lightning's ``Trainer.fit``
   registered its own SIGTERM handler (which does a collective inside the handler and would
   deadlock when ranks get the signal at different times): from then on ours are the only
   ones. A handler records the signal (which, when) and calls ``StopRequest.request``; it does
   no I/O and no collective. In any other process (a forked DataLoader worker inherits the
   handlers) it does nothing, and DataLoader workers ignore both signals
   (:class:`lmtrain.signals.WorkerSignalGuard`: torch's own worker SIGTERM handler would kill them and crash
   the training process before it reaches the step boundary).
2. :class:`StopAgreement`, at every optimizer-step boundary, runs ONE all-reduce (MAX) of a
   4-number tensor ``[stop requested, SIGTERM seen, warning seen, -first signal time]``: every
   rank learns at the same step that some rank was asked to stop, and which signals arrived
   where. All ranks then take part in the checkpoint (CheckpointManager.save: COMPLETE after
   every rank finished, ``latest`` last) and the Trainer stops.
3. After the fit, rank 0 decides (:func:`lmtrain.policy.decide`) the ledger reason from the signals, the run's markers
   (``CANCELLED``, ``DONE``), the job's SLURM state (``launcher.core.slurm``, from the main loop,
   never from the handler: :mod:`lmtrain.job_facts`) and the loop guards; the ledger ``end`` line is written; then
   :meth:`Preemption.after_end` calls ``scontrol requeue`` LAST when the job must requeue
   itself (a time limit; a stop whose job SLURM is not already requeueing).
4. At the start of the next attempt :func:`lmtrain.policy.start_gate` (rank 0, before the rendezvous, its
   answer published for the other ranks) records a previous attempt that has no ``end`` line
   (node failure / SIGKILL) and ends at once, without training, an attempt of a run that is
   ``DONE`` or ``CANCELLED`` or over a loop guard.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from launcher.core import slurm
from launcher.core.atomic import write_private
from launcher.core.checkpoint_index import newest_complete
from launcher.core.rundir import (
    DONE,
    AttemptEnd,
    AttemptStart,
    Heartbeat,
    Ledger,
    LedgerAttempt,
    LedgerNote,
    append_jsonl,
    is_cancelled,
    read_done_step,
)
from lmtrain.bad_nodes import bad_node_facts, exclude_nodes
from lmtrain.first_death import describe, find_first_death, log_size
from lmtrain.job_facts import (
    _nodes_failed,
    _previous_attempt_state,
    _seconds_left,
    _slurm_job_facts,
    _why_completing,
)
from lmtrain.policy import (
    GATE_NAME,
    SLURM_QUERY_TIMEOUT_S,
    EndFacts,
    Gate,
    Policy,
    StartFacts,
    _signal_names,
    decide,
    start_gate,
)
from lmtrain.signals import SignalOwner, _adopt_early, guard_dataloader_workers, release_early_signals

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the start gate (I/O)
def gate_path(run_dir: Path, env) -> Path:
    return Path(run_dir) / "rendezvous" / GATE_NAME.format(key=env.rendezvous_key)


def decide_start(plan, env, run_dir: Path, history: list[LedgerAttempt]) -> Gate:
    """Rank 0, before the rendezvous: decide from the ledger's ``history``, append a missing end
    line, publish the answer."""
    policy = Policy.from_plan(plan.preemption)
    run_dir = Path(run_dir)
    ledger = Ledger(plan.paths.ledger)
    ckpt = newest_complete(plan.paths.checkpoint_dir)
    previous_state = None
    if history and history[-1].reason is None and env.launcher == "slurm" and env.restart_count > 0:
        previous_state = _previous_attempt_state(env.job_id)
    done, done_step = read_done_step(run_dir)
    gate = start_gate(StartFacts(
        done_step=done_step, done_marker=done, cancelled_marker=is_cancelled(run_dir),
        start_step=ckpt.step if ckpt is not None else 0, restart_count=env.restart_count, job_id=env.job_id,
        history=history, previous_state=previous_state, max_steps=plan.trainer.max_steps,
    ), policy)
    if gate.previous_end is not None:
        append_jsonl(ledger.path, gate.previous_end)  # an AttemptEnd, as JSON (the gate travels as JSON)
    if not gate.exit and done:
        log.warning("the run finished at step %s before; continuing to trainer.max_steps(%s)",
                    done_step, plan.trainer.max_steps)
        (run_dir / DONE).unlink(missing_ok=True)
    path = gate_path(run_dir, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, gate.to_json())  # before the rendezvous file: a rank that sees that one sees this
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
        release_early_signals()
    return 0


def _write_skipped_attempt(plan, env, attempt: int, gate: Gate) -> None:
    if env.rank == 0:
        ckpt = newest_complete(plan.paths.checkpoint_dir)
        step = ckpt.step if ckpt is not None else 0
        now = time.time()
        ledger = Ledger(plan.paths.ledger)
        ledger.write(AttemptStart(attempt=attempt, job_id=env.job_id, restart_count=env.restart_count, time=now,
                                  start_step=step, nodes=list(env.nodes), world_size=env.world_size))
        ledger.write(AttemptEnd(attempt=attempt, job_id=env.job_id, time=now, end_step=step,
                                reason=gate.reason or "", detail=gate.detail or "", skipped=True))
        Heartbeat(plan.paths.heartbeat, attempt=attempt, job_id=env.job_id, world_size=env.world_size).emit(
            "end", step=step, reason=gate.reason)


# --------------------------------------------------------------------------- the agreement callback


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
    """At every ``preemption.agree_every_n_steps``-th optimizer-step boundary: one all-reduce of
    4 numbers decides whether all ranks stop now.

    The flags live on the CPU and go through a gloo group of their own, made when training
    starts: the agreement never waits for the accelerator (no device-to-host copy of a CUDA
    tensor, which would wait for every kernel queued before it) and never queues behind the
    gradient buckets on NCCL. Its cost per step is one small CPU round trip between the ranks
    (bench/step_overhead.py measures it), 1/K of that with K = agree_every_n_steps.

    Must come after the CheckpointCallback (it uses its collective ``save``).
    """

    def __init__(self, controller: Preemption, checkpoints) -> None:
        self.controller = controller
        self.stop = controller.stop
        self.checkpoints = checkpoints
        self._seen_step: int | None = None
        self._group: Any = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step
        self._group = _cpu_group(trainer, self.controller.plan.spec)
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
            dtype=torch.float64,  # on the CPU: reading it back never waits for the accelerator
        )
        if self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)  # the one collective per boundary
        requested, term, warning, neg_first = flags.tolist()
        if requested <= 0:
            return None
        return AgreedStop(step=step, term=term > 0, warning=warning > 0,
                          signal_time=-neg_first if neg_first > -1e299 else None)


def _cpu_group(trainer, spec: dict[str, Any]) -> Any:
    """A gloo process group over all ranks for the stop flags (None on one rank). Every rank
    makes it at the same point (on_train_start), as torch.distributed requires."""
    import torch.distributed as dist

    from lmtrain.watchdog import process_group_timeout

    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    # Its own group also when the training runs on gloo: one code path (the one tested on CPU),
    # and the flags never queue behind DDP's gradient buckets.
    return dist.new_group(backend="gloo", timeout=process_group_timeout(spec))


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
        stop.check_every_n_steps = self.policy.agree_every_n_steps
        self._exclude: list[str] = []  # nodes the requeued job keeps off (decide, then after_end)
        # srun's task lines of this attempt (lmtrain.first_death) start at the log's size now
        self._srun_log = plan.slurm.error.replace("%j", env.job_id) if env.launcher == "slurm" else None
        self._srun_offset = log_size(self._srun_log) if env.rank == 0 else 0

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
            grace = self.plan.preemption.grace_seconds
            if term and grace and seconds > 0.5 * grace and self.env.rank == 0:
                log.warning("SIGTERM to checkpoint complete took %.1f s of the partition's GraceTime of %s s: "
                            "a slower save would be killed (raise GraceTime, or checkpoint less state)",
                            seconds, grace)
        if self.env.rank != 0:
            if outcome.reason != "completed" and agreed is not None and not crashed:
                outcome.reason = "preempted"  # rank 0 writes the real reason; others only exit cleanly
            return

        if crashed and outcome.reason == "crashed":
            self._blame_first_death(outcome)
        info = None
        if self.env.launcher == "slurm" and outcome.end_step < self.plan.trainer.max_steps:
            info = _slurm_job_facts(self.env.job_id)
        ckpt = newest_complete(self.plan.paths.checkpoint_dir)
        history = [a for a in Ledger(self.plan.paths.ledger).attempts() if a.attempt != self.attempt]
        facts = EndFacts(
            end_step=outcome.end_step, start_step=ctx.start_step, max_steps=self.plan.trainer.max_steps,
            checkpoint_step=ckpt.step if ckpt is not None else None, stopped=agreed is not None, crashed=crashed,
            term=term, warning=warning, warning_name=self.signals.warning_name,
            requested_reason=self.stop.reason if self.stop.requested and not (term or warning) else None,
            error=outcome.detail if crashed else None,
            cancelled_marker=is_cancelled(self.run_dir), launcher=self.env.launcher,
            job_id=self.env.job_id, restart_count=self.env.restart_count,
            slurm_state=_why_completing(self.env, info) or (info or {}).get("JobState"),
            preempting=(info or {}).get("PreemptTime", "None") not in ("None", "", "Unknown"),
            slurm_restarts=int(info["Restarts"]) if info and str(info.get("Restarts", "")).isdigit() else None,
            nodes_down=_nodes_failed(self.env, info) if info is not None else [],
            seconds_left=_seconds_left(info, signal_time) if signal_time is not None else None,
            history=history, disk_full=outcome.extra.get("disk_full"), job_nodes=self.plan.topology.nodes,
            preflight=outcome.extra.get("preflight"),
        )
        if self.env.launcher == "slurm" and (facts.nodes_down or outcome.reason in ("hang", "preflight_failed")):
            bad_node_facts(self.plan, self.env, self.attempt, facts, info, hung=outcome.reason == "hang")
        d = decide(facts, self.policy)
        log.info("attempt %d ends: %s (%s)", self.attempt, d.reason, d.detail)
        outcome.reason, outcome.detail, outcome.requeued = d.reason, d.detail, d.requeued
        outcome.exit_code = max(outcome.exit_code, d.exit_code)
        self._action = d.action
        self._exclude = d.exclude
        if d.action is None and d.exclude and slurm.state_word(facts.slurm_state or "") == "PENDING":
            # SLURM requeued the job itself (a node failure): exclude now, before the end line. The
            # failed node's slurmd kills this rank within seconds, before after_end would run.
            exclude_nodes(self.plan, self.env, self.attempt, d.exclude)
            self._exclude = []

    def _blame_first_death(self, outcome) -> None:
        """Rank 0: name the rank that died first (lmtrain.first_death), not this rank's symptom."""
        env, per_node = self.env, max(1, self.plan.topology.tasks_per_node)
        node_of = {r: env.nodes[0] if env.launcher == "local" else
                   env.nodes[r // per_node] if r // per_node < len(env.nodes) else "?" for r in range(env.world_size)}
        death = find_first_death(self.run_dir, self.attempt, world_size=env.world_size, me=env.rank,
                                 node_of=node_of, srun_log=self._srun_log, srun_offset=self._srun_offset)
        if death is None:
            return
        outcome.extra["first_death"] = death
        if death["rank"] != env.rank:  # else the detail already is this rank's own error
            outcome.detail = f"{describe(death)}; rank {env.rank} saw: {outcome.detail}"[:2000]
            log.error("%s", describe(death))

    def after_end(self, ctx, outcome) -> None:
        """Rank 0, LAST (checkpoint complete, ledger and heartbeat written): requeue or cancel."""
        try:
            if self.env.rank != 0:
                return
            if self._action is None:
                exclude_nodes(self.plan, self.env, self.attempt, self._exclude)  # SLURM requeued it itself
                return
            try:
                if self._action == "requeue":
                    log.info("requeueing job %s (scontrol requeue)", self.env.job_id)
                    slurm.requeue(self.env.job_id, timeout=SLURM_QUERY_TIMEOUT_S)
                    exclude_nodes(self.plan, self.env, self.attempt, self._exclude)
                elif self._action == "cancel":
                    log.info("cancelling job %s: %s", self.env.job_id, outcome.detail)
                    slurm.cancel([self.env.job_id], timeout=SLURM_QUERY_TIMEOUT_S)
            except Exception as exc:
                log.error("%s of job %s failed: %s", self._action, self.env.job_id, exc)
                Ledger(self.plan.paths.ledger).write(LedgerNote(
                    event=f"{self._action}_failed", time=time.time(),
                    fields={"attempt": self.attempt, "job_id": self.env.job_id, "detail": str(exc)[:500]},
                ))
                outcome.exit_code = outcome.exit_code or 1
        finally:
            self.signals.restore()


__all__ = [
    "AgreedStop", "Preemption", "StopAgreement", "decide_start", "finish_without_training", "gate_path", "read_gate",
]
