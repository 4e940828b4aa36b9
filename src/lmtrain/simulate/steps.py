"""One attempt of one scale-harness rank: what lmtrain.task.training does for a Lightning rank, with
a sleep for a step (lmtrain.simulate says what is real).

Per step: nothing touches the filesystem. Per logging step (``trainer.log_every_n_steps``): the
timing line, rank 0's straggler watch woken, rank 0's heartbeat line, the profile poll (a ``stat``
of ``profile-request.json``). Every ``preemption.agree_every_n_steps`` steps: the stop flags'
all-reduce; an agreed stop checkpoints and ends the attempt. Every ``checkpoint.every_n_steps`` and
at the end: a checkpoint of tiny shards. Then the preemption controller settles the outcome, the
records are written and rank 0 requeues, cancels or restarts in place, as after a real fit.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from lmcore.run.rundir import RunLayout
from lmtrain import faults
from lmtrain.distributed.node_share import local_copy, training_share
from lmtrain.observe.attempt import AttemptRecords, Outcome
from lmtrain.observe.profile_request import RequestPoll
from lmtrain.observe.timing_lines import TimingLines
from lmtrain.preemption.controller import Preemption, end_attempt
from lmtrain.preemption.stop_flags import agreed_from, flags_of
from lmtrain.simulate import fs_count, shards
from lmtrain.simulate.collective import Star

log = logging.getLogger("lmtrain")

JOIN_TIMEOUT_S = 300.0  # as the rendezvous waits for rank 0 (lmtrain.distributed.task_env)


def train(plan: Any, env: Any, attempt: int, resume: str | None, *, addr: str, port: int) -> int:
    """Every rank: this attempt of the harness; its exit code (as lmtrain.task.training.train's)."""
    from lmtrain.checkpoint.completion import CheckpointError

    records = AttemptRecords(plan, env, attempt)
    ctl = Preemption(plan, env, attempt)
    ctl.start()
    try:
        star = Star(env.rank, env.world_size, addr, port, timeout_s=JOIN_TIMEOUT_S)
        ckpt = _resume(plan, env, attempt, resume, ctl)
    except CheckpointError as exc:
        log.error("cannot resume: %s", exc)
        records.refused(-1, f"cannot resume: {exc}")
        ctl.tell_batch_script("none", [])
        ctl.signals.restore()
        return 2
    start_step = ckpt.step if ckpt is not None else 0
    records.started(start_step, resumed_from=str(ckpt.path) if ckpt is not None else None)
    loop = _Loop(plan, env, attempt, records, ctl, star, start_step)
    try:
        outcome = loop.run()
    except BaseException as exc:
        fs_count.phase("end")  # its last words are the end's, not the step's it failed in
        outcome = ctl.failed(exc, loop.step, records)
    finally:
        fs_count.phase("end")  # the straggler watch's last look, as the timing closes, included
        loop.close()
    return end_attempt(ctl, records, None, ctl.settle(outcome, start_step))


def _resume(plan: Any, env: Any, attempt: int, resume: str | None, ctl: Preemption) -> Any:
    """The checkpoint rank 0 chose, every file checked against its checksum (the real verification,
    each rank its share), and this rank's shard read back; None: a fresh start."""
    from lmtrain.checkpoint.resume_point import agreed_checkpoint, resume_point

    ckpt = agreed_checkpoint(plan.paths.checkpoint_dir, resume, rank=env.rank)
    if ckpt is None:
        return None
    ckpt = resume_point(plan, env, attempt, ckpt, node=training_share(os.environ, env.node_rank))
    shards.load(ckpt, env)
    return ckpt


class _Loop:
    def __init__(self, plan: Any, env: Any, attempt: int, records: AttemptRecords, ctl: Preemption, star: Star,
                 start_step: int) -> None:
        from lmtrain.health.straggler_watch import watch_for

        self.plan, self.env, self.attempt, self.records, self.ctl, self.star = plan, env, attempt, records, ctl, star
        self.job = plan.job_spec()
        self.sim = self.job.simulate
        self.step = start_step
        layout = RunLayout.of_plan(plan)
        self.watch = watch_for(plan, env, records, [list(range(env.world_size))], self._leave_slow_node)
        self.timing = TimingLines(layout.node_timing(attempt, env.node_rank), rank=env.rank, node=env.node_name,
                                  after_write=self.watch.poke if self.watch else None,
                                  on_close=self.watch.stop if self.watch else None)
        self.poll = RequestPoll(local_copy(layout.profile_request), attempt=attempt, rank=env.rank)
        self.profile_dir = lambda request_id: layout.profile_dir(attempt, request_id)
        self.identity = {"job_id": env.job_id, "attempt": attempt, "logger": None}

    def _leave_slow_node(self, fields: dict[str, Any], text: str) -> None:
        self.ctl.leave_slow_node(str(fields.get("node") or ""), text, self.records.idle_spares())

    def run(self) -> Outcome:
        t = self.plan.trainer
        max_steps, every_log = t.max_steps, t.log_every_n_steps
        every_ckpt, agree = self.job.checkpoint.every_n_steps, max(1, self.plan.preemption.agree_every_n_steps)
        self.timing.open()  # before the first step: a logging step's operations are the steady ones
        interval_began, interval_from, busy = time.perf_counter(), self.step, 0.0
        fs_count.phase("step")
        first = True
        while self.step < max_steps:
            t0 = time.perf_counter()
            time.sleep(self.sim.step_s)
            busy += time.perf_counter() - t0  # the step's "forward": what a straggler is scored on
            self.step += 1
            faults.point("train.batch_end", step=self.step)  # the fault seam, as a Lightning rank's (kill, slow, ...)
            logging_step = self.step % every_log == 0 or self.step == max_steps
            if logging_step:
                fs_count.phase("log_step")
                now = time.perf_counter()
                self.timing.write(self.step, steps=self.step - interval_from, micro_batches=self.step - interval_from,
                                  totals={"forward": busy}, wall_s=now - interval_began)
                interval_began, interval_from, busy = now, self.step, 0.0
                self.records.heartbeat.emit("step", step=self.step, max_steps=max_steps)
                self._profile_if_asked()
            if self.step % agree == 0 or self.step == max_steps:
                stop = agreed_from(self.star.allreduce_max(flags_of(self.ctl)), self.step)
                if stop is not None:
                    return self._stop(stop)
            if self.step % every_ckpt == 0 or self.step == max_steps:
                fs_count.phase("checkpoint")
                shards.save(self.star, self.plan, self.env, self.step, size=self.sim.shard_bytes, identity=self.identity)
            fs_count.step_done("log_step" if logging_step else "step")
            if first:
                fs_count.note(cpu_to_first_step_s=round(time.process_time(), 3))  # this process's CPU until its first step
                first = False
            fs_count.phase("step")
        return Outcome(reason="completed", end_step=self.step)

    def _stop(self, stop: Any) -> Outcome:
        """Every rank agreed to stop at this step: its checkpoint, then the attempt ends."""
        fs_count.phase("stop")
        ctl = self.ctl
        if not ctl.stop.requested:
            ctl.stop.request("peer", "another rank was asked to stop")
        log.info("stop agreed at step %d (SIGTERM: %s, warning: %s): checkpointing", self.step, stop.term, stop.warning)
        t0 = time.perf_counter()
        path = shards.save(self.star, self.plan, self.env, self.step, size=self.sim.shard_bytes, identity=self.identity)
        stop.checkpoint_path, stop.checkpoint_held_s, stop.checkpoint_done_at = str(path), time.perf_counter() - t0, time.time()
        ctl.agreed, ctl.stop.agreed_step, ctl.stop.checkpoint_path = stop, self.step, str(path)
        return Outcome(reason=ctl.stop.reason or "preempted", end_step=self.step,
                       detail=f"{ctl.stop.detail or ctl.stop.reason}; checkpoint step-{self.step} complete")

    def _profile_if_asked(self) -> None:
        """A profile request for this rank: the harness has no operators to time; it answers at once
        with an empty table, so that ``lmlaunch profile`` on a harness run completes."""
        request = self.poll.asked(self.step)
        if request is None:
            return
        from lmcore.atomic import write_json

        out = Path(self.profile_dir(request["id"]))
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / f"top-rank-{self.env.rank}.json", {
            "rank": self.env.rank, "node": self.env.node_name, "steps": 0, "from_step": self.step,
            "to_step": self.step, "ops": [], "simulated": True})

    def close(self) -> None:
        self.timing.close()
        self.star.close()
