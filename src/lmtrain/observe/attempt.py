"""The one owner of an attempt's records: the ledger's ``start`` and ``end`` lines, the
heartbeat's ``start`` and ``end`` events, the ``DONE`` marker, this rank's last words and the
webhook messages (docs/run-directory.md says what each holds).

Every path that starts or ends an attempt writes through :class:`AttemptRecords`: a trained
attempt (:mod:`lmtrain.task.entry`), one the start gate refuses (:mod:`lmtrain.preemption.gate`),
one that cannot resume, an eval job (:mod:`lmtrain.task.evaluate`), the hang watchdog's last act
(:mod:`lmtrain.health.watchdog`) and the end line of an earlier attempt that died without writing one.
Rank 0 writes the ledger, the heartbeat and ``DONE``; every rank may write its own last words.
How an attempt ended (:class:`Outcome`) is decided by :mod:`lmtrain.preemption.controller`.

Torch-free: the start gate uses it before the frameworks are imported.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from lmcore.atomic import write_atomic
from lmcore.run.rundir import AttemptEnd, AttemptStart, Heartbeat, LastWords, Ledger, RunLayout, is_peer_lost

log = logging.getLogger("lmtrain")


@dataclass
class Outcome:
    """How this attempt ended (what the ledger's ``end`` line says)."""

    reason: str  # completed | preempted | timeout | cancelled | crashed | ... (docs/run-directory.md)
    end_step: int
    detail: str | None = None
    requeued: bool = False
    exit_code: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # ledger extras: signal_time, checkpoint_seconds, ...
    error: BaseException | None = None  # raised again once the attempt's records are written
    action: str | None = None  # "requeue" | "cancel" | None: what rank 0 does LAST (after the records)
    exclude: list[str] = field(default_factory=list)  # nodes the requeued job keeps off (ExcNodeList)


@dataclass(frozen=True)
class MissingEnd:
    """An earlier attempt that never wrote its end line (node failure, SIGKILL), as the start gate
    judged it (:func:`lmtrain.preemption.policy.start_gate`)."""

    attempt: int
    job_id: str
    end_step: int
    reason: str
    detail: str
    restart: str | None = None  # "in_place": the batch script started the ranks again (launcher.submit.script)


class AttemptRecords:
    """The records of one attempt of one task (``plan``: the run's plan; ``env``: this task's
    :class:`lmtrain.distributed.task_env.TaskEnv`)."""

    def __init__(self, plan: Any, env: Any, attempt: int) -> None:
        self.plan, self.env, self.attempt = plan, env, attempt
        self.layout = RunLayout.of_plan(plan)
        self.writer = env.rank == 0
        self.ledger = Ledger(plan.paths.ledger)
        self.heartbeat = Heartbeat(plan.paths.heartbeat, attempt=attempt, job_id=env.job_id,
                                   world_size=env.world_size, enabled=self.writer)
        self.notifier: Any = None

    # -- the ledger's lines ------------------------------------------------------------------
    def start_line(self, start_step: int, *, world_size: int | None = None, at: float | None = None) -> None:
        """Rank 0: the ledger's ``start`` line."""
        if self.writer:
            env = self.env
            self.ledger.write(AttemptStart(
                attempt=self.attempt, job_id=env.job_id, restart_count=env.restart_count, time=at or time.time(),
                start_step=start_step, nodes=list(env.nodes),
                world_size=env.world_size if world_size is None else world_size,
                spares=(spares := self.idle_spares()), groups=self.node_groups(),
                profile=getattr(self.plan, "profile", None) or None,
                gpus=self.plan.slurm.gpus_per_node * (len(env.nodes) + len(spares or ())) or None,
            ))

    def node_groups(self) -> dict[str, str | None] | None:
        """Each of the attempt's nodes' leaf switch or block (a plan with a placement; else None)."""
        groups = (getattr(self.plan, "placement", None) or {}).get("groups")
        if not groups:
            return None
        from lmcore.job.network import crossing_units, groups_by_node

        known = groups_by_node(groups)
        where = {n: known.get(n) for n in self.env.nodes}
        unit = int(self.plan.placement.get("group_nodes") or 1)
        crossing = crossing_units(list(self.env.nodes), {n: g for n, g in where.items() if g}, unit)
        if crossing:  # SLURM listed the job's nodes so that a model-parallel group spans two switches or blocks
            log.warning("notice: the model-parallel group(s) on %s cross a switch or block (%s)",
                        ", ".join("+".join(u) for u in crossing), ", ".join(f"{n}: {where[n]}" for u in crossing for n in u))
        return where

    def idle_spares(self) -> list[str] | None:
        """A job with spare nodes: the allocation's nodes the ranks do not run on and no restart in
        place left out (None: a job without spares)."""
        if not getattr(self.plan.slurm, "spare_nodes", 0) or self.env.launcher != "slurm":
            return None
        from hostlist import expand_hostlist

        from lmcore.run.rundir import left_out_of

        job = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))  # as it was at the job's start
        out = set(left_out_of(self.ledger.entries(), self.env.job_id))
        return [n for n in job if n not in self.env.nodes and n not in out]

    def end_line(self, outcome: Outcome, *, skipped: bool = False, at: float | None = None) -> bool:
        """Rank 0: the ledger's ``end`` line, once per attempt (the hang watchdog may have written
        it first); False when one was there already."""
        if not self.writer:
            return False
        return self.ledger.write_end_once(AttemptEnd(
            attempt=self.attempt, job_id=self.env.job_id, time=at or time.time(), end_step=outcome.end_step,
            reason=outcome.reason, detail=outcome.detail, requeued=outcome.requeued, extra=outcome.extra,
            skipped=skipped,
        ))

    def missing_end(self, missing: MissingEnd) -> None:
        """Rank 0, at the start gate: the end line an earlier attempt could not write."""
        if self.writer:
            self.ledger.write(AttemptEnd(
                attempt=missing.attempt, job_id=missing.job_id, time=time.time(), end_step=missing.end_step,
                reason=missing.reason, detail=missing.detail, requeued=True,
                extra={"restart": missing.restart} if missing.restart else {},
            ))

    # -- whole attempts ----------------------------------------------------------------------
    def started(self, start_step: int, *, resumed_from: str | None) -> None:
        """A training attempt begins at ``start_step``: ledger, heartbeat, the ``started`` message."""
        from lmtrain.observe.notify import Notifier

        self.start_line(start_step)
        env, max_steps = self.env, self.plan.trainer.max_steps
        self.heartbeat.emit("start", step=start_step, max_steps=max_steps, resumed_from=resumed_from)
        self.notifier = Notifier(self.plan.job_spec().notify, run=self.plan.run_name, attempt=self.attempt,
                                 job_id=env.job_id, enabled=self.writer)
        self.notifier.send("started", f"attempt {self.attempt} started on {','.join(env.nodes)} from step "
                           f"{start_step}", nodes=list(env.nodes), start_step=start_step, max_steps=max_steps)

    def skipped(self, step: int, reason: str, detail: str) -> None:
        """An attempt that ends before training (the start gate's answer): start and end at once."""
        now = time.time()
        self.start_line(step, at=now)
        self.end_line(Outcome(reason=reason, end_step=step, detail=detail), skipped=True, at=now)
        self.heartbeat.emit("end", step=step, reason=reason)

    def refused(self, step: int, detail: str) -> None:
        """An attempt that cannot resume from ``step`` (not retryable): start and a crashed end."""
        now = time.time()
        self.start_line(step, at=now)
        self.end_line(Outcome(reason="crashed", end_step=step, detail=detail[:2000]), at=now)

    def hung(self, step: int, detail: str, at: float) -> None:
        """The hang watchdog's end line, written before it ends the process (rank 0)."""
        self.end_line(Outcome(reason="hang", end_step=step, detail=detail), at=at)
        self.heartbeat.emit("end", step=step, reason="hang")

    def ended(self, outcome: Outcome) -> bool:
        """A training attempt ended: ``DONE`` when it completed, the end line, the heartbeat, the
        end messages (a message never costs the requeue that follows). False on rank 0 when the
        end line was there already (rank 0's hang watchdog ended the attempt, and acted on it)."""
        if self.writer and outcome.reason == "completed":
            self.done(outcome.end_step)
        wrote = self.end_line(outcome)
        self.heartbeat.emit("end", step=outcome.end_step, reason=outcome.reason, **outcome.extra)
        if self.writer and self.notifier is not None:
            from lmtrain.observe.notify import notify_end

            try:
                notify_end(self.notifier, self.plan, outcome, self.attempt)
            except Exception as exc:
                log.warning("notify: could not compose the end message: %s", exc)
        return wrote or not self.writer

    def done(self, step: int) -> None:
        """Rank 0: the run is finished at ``step`` (durable: fsynced, atomic)."""
        write_atomic(self.layout.done, f"{step}\n", durable=True)

    def last_words(self, exc: BaseException) -> None:
        """This rank dies of ``exc``: say so where rank 0 looks for the first death
        (:mod:`lmtrain.preemption.first_death`)."""
        env = self.env
        text = f"{type(exc).__name__}: {exc}".strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        last = text.splitlines()[-1] if text else first
        node = env.nodes[env.node_rank] if env.node_rank < len(env.nodes) else ""
        try:
            LastWords(rank=env.rank, node=node, pid=os.getpid(), time=time.time(), how="exception",
                      detail=(first + (f" ... {last}" if last != first else ""))[:500],
                      peer_lost=is_peer_lost(text)).write(self.layout.run_dir, self.attempt)
        except OSError as err:
            log.warning("could not write this rank's last words: %s", err)

    def close(self) -> None:
        """Wait (bounded) for the end messages to be delivered."""
        if self.notifier is not None:
            self.notifier.close()

