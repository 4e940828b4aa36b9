"""A run that names several clusters (the spec's ``clusters``): planned on each, checked that each
can run it and that they can take over each other's checkpoints, and the choice of where it goes.

Planning reads the profiles and the spec (launcher.planning.resolve); the choice itself is pure,
on the answers launcher.submit.start_estimates got from the clusters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from launcher.planning.resolve import Resolved, resolve
from lmcore.errors import SpecError
from lmcore.job.parallelism import Parallelism

TIE_S = 60.0  # start estimates this close are a tie: fewer of the user's pending jobs, then the order listed


@dataclass(frozen=True)
class Answer:
    """What one cluster said when asked when the run would start (``sbatch --test-only``)."""

    cluster: str
    accepted: bool  # the controller would take the job
    start: float | None  # its start estimate (epoch s); None: none given
    message: str  # the controller's words, or why it was not asked or did not answer
    pending: int | None = None  # the user's pending jobs there (None: not known)
    answered: bool = True  # False: skipped (no answer within the bound, or not reachable)


def plan_each(spec_path: str, overrides: Sequence[str], names: Sequence[str], environ: Mapping[str, str] | None,
              python: str | None, *, force: bool = False, done: Resolved | None = None) -> list[Resolved]:
    """The run planned on each named cluster, in the order named. A cluster that cannot run it (its
    profile lacks what the run needs: a partition, GPUs, memory, ...) is refused by name, as are
    clusters that could not take over each other's checkpoints; nothing is submitted."""
    plans: list[Resolved] = []
    problems: list[str] = []
    for name in names:
        if done is not None and done.profile.name == name:  # planned already (the first, by resolve)
            plans.append(done)
            continue
        try:
            plans.append(resolve(spec_path, list(overrides), name, environ, python, force=force))  # keeps clusters
        except SpecError as exc:
            problems += [f"clusters: {name}: {p.removeprefix('--cluster: ')}" for p in exc.problems]
    if problems:
        raise SpecError([*problems, "each cluster the run names must be able to run it (the run may be placed or "
                         "moved to any of them): fix its profile or leave it out of clusters"], source=spec_path)
    problems = shared_run_problems(plans)
    if problems:
        raise SpecError(problems, source=spec_path)
    return plans


def shared_run_problems(plans: Sequence[Resolved]) -> list[str]:
    """Why these clusters could not carry one run between them: one run directory (the runs root
    they share), reached by lmlaunch on this machine, the same model and parallel layout."""
    first = plans[0]
    problems = []
    for r in plans:
        if r.profile.login is not None and (r.spec.checkpoint.local_dir is not None or
                                            not _inside(r.plan.paths.checkpoint_dir, r.plan.paths.run_dir)):
            problems.append(f"clusters: {r.profile.name} is reached over SSH: the run directory is copied there with "
                            f"its newest checkpoint, and checkpoint.dir ({r.plan.paths.checkpoint_dir}) names a path "
                            "of this machine; leave checkpoint.dir out (the run directory's checkpoints/, there too)")
    dirs = {r.profile.name: r.plan.paths.run_dir for r in plans}
    if len(set(dirs.values())) > 1:
        listed = ", ".join(f"{n}: {d}" for n, d in dirs.items())
        problems.append(f"clusters: the run's directory differs between them ({listed}): a run placed on one and "
                        "resumed on another needs one run directory, on a filesystem they share; give their profiles "
                        "the same runs_root (or set LMLAUNCH_RUNS_ROOT)")
    for r in plans[1:]:
        a, b = first.plan.parallelism, r.plan.parallelism
        if (a.data, a.zero_stage, a.tensor, a.pipeline) != (b.data, b.zero_stage, b.tensor, b.pipeline):
            problems.append(f"clusters: {first.profile.name} plans {_layout(a)}, {r.profile.name} {_layout(b)}: a "
                            "checkpoint of one could not be resumed on the other (the elastic path bridges world "
                            "sizes, not strategies or model splits)")
    return problems


def _inside(path: str, directory: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(directory))


def _layout(p: Parallelism) -> str:
    return f"{p.data.value}" + (f" ZeRO-{p.zero_stage}" if p.zero_stage else "") + f", tensor x pipeline {p.tensor}x{p.pipeline}"


def choose(answers: Sequence[Answer]) -> tuple[Answer | None, str]:
    """The cluster the run goes to, and why: of those whose controller would take the job, the
    soonest start estimate (one without an estimate comes after every one with); estimates within
    ``TIE_S`` of each other are a tie, broken by fewer of the user's pending jobs there, then by the
    order the clusters are named. None when no cluster would take it."""
    taking = [a for a in answers if a.answered and a.accepted]
    if not taking:
        return None, "no cluster would take the job"
    soonest = min(a.start if a.start is not None else math.inf for a in taking)
    tied = [a for a in taking if (a.start if a.start is not None else math.inf) <= soonest + TIE_S]
    best = min(tied, key=lambda a: a.pending if a.pending is not None else math.inf) if len(tied) > 1 else tied[0]
    if len(taking) == 1:
        why = "the only cluster that would take it" if len(answers) > 1 else "the only cluster named"
    elif len(tied) == 1:
        why = "it starts soonest"
    elif best.pending is not None and any(a.pending != best.pending for a in tied):
        why = f"it starts as soon as {', '.join(a.cluster for a in tied if a is not best)}, with fewer of your jobs pending"
    else:
        why = f"it starts as soon as {', '.join(a.cluster for a in tied if a is not best)} and is named first"
    return best, why


@dataclass(frozen=True)
class Queued:
    """The run's current job as the watcher found it on its cluster."""

    cluster: str
    job_id: str
    state: str  # SLURM's word: PENDING, RUNNING, ...
    reason: str  # squeue's: Priority, Resources, BeginTime, JobHeldUser, Dependency ...
    waited_s: float  # since it was submitted or requeued (the later)
    after_preemption: bool  # its last attempt ended preempted and requeued itself


HELD = ("JobHeldUser", "JobHeldAdmin")  # someone holds it on purpose: it is theirs to release, not moved


def move_due(q: Queued, *, after_s: float | None, on_preemption: bool) -> str | None:
    """Why the queued job should go elsewhere now, or None: only a pending job that nobody holds
    and that does not wait for another job (a dependency) is moved, after a preemption
    (``on_preemption``: the requeue's BeginTime delay is waiting too) or after ``after_s`` in the
    queue."""
    if q.state != "PENDING" or q.reason in HELD or q.reason.startswith("Dependency"):
        return None
    if on_preemption and q.after_preemption:
        return "preempted"
    if after_s is not None and q.waited_s >= after_s:
        return f"queued {q.waited_s:.0f} s (move.after {after_s:.0f} s)"
    return None


def move_target(q: Queued, here: Answer, others: Sequence[Answer]) -> tuple[Answer | None, str]:
    """Where the run goes from ``q``'s cluster (its answer ``here``: the job's own start estimate,
    or a new job's), or None: another cluster moves it only when it would start more than
    ``TIE_S`` sooner (a cluster that does not answer is never moved to)."""
    best, why = choose([a for a in others if a.cluster != q.cluster])
    if best is None:
        return None, "no other cluster would take it"
    mine = here.start if here.answered and here.start is not None else math.inf
    theirs = best.start if best.start is not None else math.inf
    if not theirs + TIE_S < mine:
        return None, f"no other cluster starts it sooner (here: {_when(mine)}, {best.cluster}: {_when(theirs)})"
    return best, f"{best.cluster} starts it sooner ({_when(theirs)} against {_when(mine)} on {q.cluster})"


def _when(t: float) -> str:
    import time

    return "no estimate" if t == math.inf else time.strftime("%H:%M:%S", time.localtime(t))
