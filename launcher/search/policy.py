"""What a search's driver does next: facts about its trials in, steps out. Pure (tested as a table).

A trial is RUNNING in the study from the moment it is asked until the driver ends it; its run is
``<search>.<number>``. The driver never has more than ``max_parallel`` trials RUNNING (queued or
running in SLURM, or asked and not yet submitted), asks a new one as soon as one ends (no trial
waits for another), and stops asking at ``trials``: asked trials are never lost or asked twice,
whatever moment the driver died at (a RUNNING trial without a job is submitted again; one whose
job SLURM still holds is waited for; one whose job is gone is ended from its run's ledger).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TrialFacts:
    number: int
    state: str  # Optuna's: RUNNING, WAITING, COMPLETE, PRUNED, FAIL
    submitted: bool  # its run has a job (the registry says so)
    job_active: bool | None  # SLURM holds that job (queued, running, requeued); None: SLURM did not answer
    end_reason: str | None = None  # the run ledger's last `end` reason (None: no end line)
    end_detail: str | None = None
    value: float | None = None  # the objective as the run logged it (None: never logged)
    cancelled: bool = False  # the run was cancelled (`lmlaunch cancel`)


@dataclass(frozen=True)
class Step:
    kind: str  # submit | complete | prune | fail | ask
    number: int | None = None  # the trial (None for ask)
    value: float | None = None
    why: str = ""


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    active: int  # trials RUNNING after the steps (queued, running or being submitted)
    done: bool  # every trial asked and ended: the search is over


def next_steps(trials: Sequence[TrialFacts], *, total: int, max_parallel: int, stopping: bool = False) -> Plan:
    """The steps of one round. ``stopping``: the search was cancelled: end what ended, ask nothing."""
    steps: list[Step] = []
    active = 0
    for t in sorted(trials, key=lambda t: t.number):
        if t.state not in ("RUNNING", "WAITING"):
            continue
        if not t.submitted:
            if stopping:
                steps.append(Step("fail", t.number, why="the search was cancelled before this trial was submitted"))
                continue
            steps.append(Step("submit", t.number, why="asked, not yet submitted"))
            active += 1
            continue
        if t.job_active is None or t.job_active:
            active += 1  # queued, running, requeued after a preemption; or SLURM did not answer: wait
            continue
        steps.append(_ended(t))
    asks = 0 if stopping else max(0, min(max_parallel - active, total - len(trials)))
    steps += [Step("ask")] * asks
    ending = sum(1 for s in steps if s.kind in ("complete", "prune", "fail"))
    running = sum(1 for t in trials if t.state in ("RUNNING", "WAITING"))
    remaining = running - ending  # RUNNING once these steps are taken (submits stay RUNNING)
    done = remaining == 0 and asks == 0 and (stopping or len(trials) >= total)
    return Plan(tuple(steps), active + asks, done)


def _ended(t: TrialFacts) -> Step:
    """A trial whose job SLURM no longer holds: how its run's ledger says it ended."""
    if t.cancelled or t.end_reason == "cancelled":
        return Step("fail", t.number, why="cancelled")
    if t.end_reason == "completed":
        if t.value is None:
            return Step("fail", t.number, why="completed, but the objective's metric was never logged")
        return Step("complete", t.number, value=t.value, why="completed")
    if t.end_reason == "pruned":
        return Step("prune", t.number, why=t.end_detail or "pruned")
    if t.end_reason is None:
        return Step("fail", t.number, why="its job ended before the run wrote an end line (the task never started, "
                                          "or it was killed): `lmlaunch history` and `lmlaunch logs --errors` say more")
    return Step("fail", t.number, why=f"ended {t.end_reason}" + (f": {t.end_detail}" if t.end_detail else ""))


def objective(values: Sequence[float], *, at: str, direction: str) -> float | None:
    """The trial's value from its run's logged values, in order: the last, or the best."""
    if not values:
        return None
    if at == "last":
        return values[-1]
    return min(values) if direction == "minimize" else max(values)
