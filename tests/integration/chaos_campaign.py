"""A chaos campaign: one training run on a local worker cluster (2 nodes x 1 rank and a spare, a
checkpoint every few steps, the warm restart in place on), the faults of a schedule
(chaos_schedule.py) landed on it for real (chaos_faults.py) at their steps, and the verdict
(chaos_verdict.py) read off what the run and the cluster say once it ends.

The suite runs a short campaign with a fresh seed (tests/integration/test_chaos.py); the bench a
long one (bench/chaos.py). Both call :func:`run`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import waiting
from chaos_faults import Done, Target, inject, undo_when_possible
from chaos_schedule import Fault, Schedule
from preempt_helpers import (
    current_step,
    final_weights,
    ledger,
    log_tail,
    losses_by_step,
    run_progress,
    start_if_begin_time,
    starts,
    submit,
    weights_digest,
)
from slurm_helpers import TERMINAL

from launcher.localcluster import cluster
from launcher.localcluster.config import Layout, Ports
from lmcore.errors import UserError
from lmcore.run.checkpoint_index import complete_checkpoints
from lmcore.slurm import admin as rehearsal, client as slurm


# What the run asks beyond the uninterrupted reference's spec (none of it changes a number): a
# spare node, retries enough for every fault a schedule may hold, a hang watchdog that fires
# within seconds (a stopped rank), and a shorter checkpoint interval given by the schedule.
def overrides(schedule: Schedule) -> tuple[str, ...]:
    n = len(schedule.faults) + 5
    return (f"trainer.max_steps={schedule.max_steps}", f"checkpoint.every_n_steps={schedule.every}",
            "resources.spare_nodes=1", f"preemption.max_crash_retries={n}", f"preemption.max_requeues={n}",
            f"preemption.no_progress_attempts={n}", "watchdog.hang_timeout_s=10", "watchdog.exit_grace_s=5")


@dataclass
class Landing:
    """One fault as it landed: when, at which step of which attempt, with which checkpoints complete."""

    fault: Fault
    at: float
    step: int  # the newest step in the heartbeat when it landed
    attempt: int | None  # the attempt running when it landed (None: none was)
    complete: tuple[int, ...]  # the complete checkpoints' steps just before it landed
    done: Done
    undone: str = ""


@dataclass
class Campaign:
    schedule: Schedule
    name: str
    job: str
    run_dir: Path
    landings: list[Landing] = field(default_factory=list)
    final_state: str = ""
    began: float = 0.0
    ended: float = 0.0


def _attempt_now(run_dir: Path, job: str) -> int | None:
    info = slurm.show_job(job) or {}
    begun = starts(run_dir)
    return begun[-1]["attempt"] if info.get("JobState") == "RUNNING" and begun else None


def _start_early(job: str) -> None:
    """A requeued job waits for its BeginTime (~2 min here); start it once it may (tests' own rule,
    preempt_helpers.start_if_begin_time), also when SLURM gives another reason (a job requeued after
    its batch node failed pends as JobLaunchFailure until the same BeginTime)."""
    info = slurm.show_job(job) or {}
    if info.get("JobState") == "PENDING" and info.get("Reason") in ("JobLaunchFailure", "NodeDown"):
        begins = slurm.parse_time(info.get("EligibleTime"))
        if begins is not None and begins > time.time() and rehearsal.ready_to_start(job):
            with contextlib.suppress(UserError):
                rehearsal.start_now(job)
        return
    start_if_begin_time(job)


def _wait(run_dir: Path, job: str, reached: Callable[[], object], what: str) -> object:
    """Until ``reached()`` or the job ended, starting a requeued job at once, while the run advances."""
    def check():
        return reached() or (slurm.state_group(slurm.job_state(job)) in TERMINAL and "ended")

    return waiting.until(check, progress=run_progress(run_dir, job), poll=0.2,
                         on_poll=lambda: _start_early(job), what=f"{run_dir.name}: {what}",
                         explain=lambda: f"ledger {ledger(run_dir)}\n{log_tail(run_dir)}")


def _land(c: Campaign, target: Target, f: Fault, say: Callable[[str], None]) -> Landing:
    complete = tuple(ck.step for ck in complete_checkpoints(c.run_dir / "checkpoints"))
    step, attempt = current_step(c.run_dir), _attempt_now(c.run_dir, c.job)
    done = inject(target, f)
    landing = Landing(f, time.time(), step, attempt, complete, done)
    say(f"{time.time() - c.began:7.1f}s  step {step:>4}  {f.label()}: "
        f"{done.what if done.landed else 'did not land: ' + done.what}")
    return landing


def _undo_later(landing: Landing, say: Callable[[str], None], layout: Layout) -> threading.Thread:
    def later() -> None:
        time.sleep(landing.fault.hold_s)
        with cluster.own_conf(layout):
            landing.undone = undo_when_possible(landing.done)
        say(f"          #{landing.fault.index} undone: {landing.undone}")

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    return thread


def run(schedule: Schedule, env: dict[str, str], layout: Layout, ports: Ports, name: str, *,
        pace_s: float, say: Callable[[str], None] = print) -> Campaign:
    """Submit the run, land every fault of ``schedule`` on it, wait for its end and every fault to be
    undone. ``env``: lmlaunch's environment on the worker cluster ``layout``; the caller is inside
    ``cluster.own_conf(layout)``."""
    job, run_dir = submit(env, name, *overrides(schedule), pace_s=pace_s)
    c = Campaign(schedule, name, job, run_dir, began=time.time())
    target = Target(env, layout, ports, name, job, run_dir)
    say(f"campaign seed {schedule.seed}: run {name}, job {job}, {len(schedule.faults)} faults over "
        f"{schedule.max_steps} steps (a checkpoint every {schedule.every})")
    undoing: list[threading.Thread] = []
    for f in schedule.faults:
        if not f.overlap:
            _wait(run_dir, job, lambda s=f.after_step: current_step(run_dir) >= s, f"step {f.after_step}")
        time.sleep(f.delay_s)
        landing = _land(c, target, f, say)
        c.landings.append(landing)
        if landing.done.landed and landing.done.undo is not None:
            undoing.append(_undo_later(landing, say, layout))
    for thread in undoing:  # a node DOWN or the controller away would keep the run from ending
        thread.join()
    _wait(run_dir, job, lambda: False, "the job's end")
    c.final_state, c.ended = slurm.job_state(job), time.time()
    say(f"{c.ended - c.began:7.1f}s  job {job} ended {c.final_state}")
    return c


def reference(env: dict[str, str], name: str, max_steps: int) -> dict:
    """The uninterrupted run of the campaign's numbers (as fast as it goes, nothing acting on it): its
    per-step losses and the digest of its final weights."""
    job, run_dir = submit(env, name, f"trainer.max_steps={max_steps}", pace_s=None)
    _wait(run_dir, job, lambda: False, "the reference's end")
    state = slurm.job_state(job)
    assert state == "COMPLETED", f"the reference run {name} ended {state}\n{log_tail(run_dir)}"
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, max_steps + 1)), sorted(losses)
    weights = final_weights(run_dir)
    return {"losses": {s: v[0] for s, v in losses.items()}, "step": weights["step"], "digest": weights_digest(weights),
            "name": name}
