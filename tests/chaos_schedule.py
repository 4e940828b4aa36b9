"""A chaos campaign's schedule: which faults, when, on what, drawn from a seed (pure: no I/O).

A schedule is a list of faults, each of a kind from :data:`KINDS` (drawn by its weight), landing
after a training step (the run's heartbeat reaching it) plus a delay of up to a second, so that a
fault lands mid-step, mid-save or mid-restart as often as between steps. A fault may *overlap* the
one before it: it lands as soon as that one was injected, whatever the run is doing then (a node
failing while the ranks restart in place, a preemption during the stop checkpoint, the controller
restarted during a requeue). The same seed and settings give the same schedule; the schedule is
saved as JSON and replayed as it was (``--replay``), so any failure can be studied again.

Steps, not wall-clock times, place the faults: a campaign on a host twice as slow meets the same
faults at the same points of the training.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    """A fault kind of the catalogue: its weight in the draw, what it needs of the run, and what it is."""

    weight: float
    what: str
    target: str = ""  # "rank": one of the ranks; "node": a node the ranks run on; "": the job or the cluster
    hold: tuple[float, float] = (0.0, 0.0)  # how long the fault lasts before it is undone (s), drawn uniformly


KINDS: dict[str, Kind] = {
    "rank_kill": Kind(3.0, "a rank's training process SIGKILLed (the OOM killer)", "rank"),
    "task_kill": Kind(1.0, "a rank's whole task SIGKILLed, its agent too (SLURM killing the step on one node; "
                           "the OOM killer taking the task's cgroup)", "rank"),
    "rank_stop": Kind(1.0, "a rank's training process SIGSTOPped past the hang watchdog, never continued", "rank"),
    "node_down": Kind(2.0, "a node the ranks run on (not the batch script's) set DOWN, RESUMEd later", "node",
                      (4.0, 20.0)),
    "batch_host_down": Kind(1.0, "the batch script's node (rank 0's) set DOWN, RESUMEd later", "", (4.0, 20.0)),
    "preempt": Kind(2.0, "a preemption by a high-priority exclusive job on the run's nodes"),
    "requeue": Kind(1.0, "scontrol requeue of the run's job"),
    "time_limit": Kind(1.0, "the job's time limit lowered so that it is reached within minutes (warning signal first)"),
    "ctld_restart": Kind(1.0, "slurmctld killed, started again later (its state kept)", "", (0.0, 6.0)),
    "dbd_stop": Kind(1.0, "slurmdbd stopped for a while (accounting away)", "", (5.0, 30.0)),
    "corrupt_checkpoint": Kind(1.0, "a file of the newest complete checkpoint corrupted on disk"),
    "disk_full": Kind(1.0, "the checkpoints' filesystem filled up for a while (saves meet ENOSPC)", "", (3.0, 15.0)),
    "batch_kill": Kind(1.0, "the job's batch script SIGKILLed (its step and ranks go with it)"),
    "keeper_kill": Kind(0.5, "the job's keeper (its step beside the ranks, spare nodes) SIGKILLed: the run's "
                             "watcher is left to see the batch script's node fail"),
    "gateway_stop": Kind(1.0, "the S3 gateway the run's checkpoints go to (checkpoint.dir s3://) SIGKILLed, started "
                              "again later: the uploads it meets fail, training goes on", "", (3.0, 20.0)),
    "watcher_kill": Kind(0.5, "the run's watcher on the login side SIGKILLed (a login node's restart); started "
                              "again as its user would, once status says it is gone", "", (5.0, 30.0)),
}

# Kinds whose fault a run may survive without an attempt ending (nothing in the ledger shows it
# unless a later attempt meets its consequence): the controller or accounting away, a corrupted
# checkpoint newer ones replace, periodic saves skipped for want of room, the keeper gone (it matters
# only when the batch script's node fails before the next attempt starts it again), the watcher gone
# for a while (the same, before its user starts it again), the S3 gateway away (uploads fail and are
# retried with the next checkpoint; the bucket is judged at the end: chaos_verdict.bucket_problems).
SILENT_KINDS = frozenset({"ctld_restart", "dbd_stop", "corrupt_checkpoint", "disk_full", "keeper_kill",
                          "watcher_kill", "gateway_stop"})


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    after_step: int  # lands once the heartbeat shows this step ...
    delay_s: float  # ... and this many seconds more (or this long after the fault before it, overlapping)
    overlap: bool = False  # lands right after the fault before it instead of waiting for after_step
    target: int = 0  # the rank, or the index among the ranks' nodes
    hold_s: float = 0.0  # undone after this long (node RESUMEd, daemon started again)

    def label(self) -> str:
        on = f" rank {self.target}" if KINDS[self.kind].target == "rank" else (
            f" node #{self.target}" if KINDS[self.kind].target == "node" else "")
        when = "with the one before" if self.overlap else f"after step {self.after_step}"
        held = f", {self.hold_s:.1f}s" if self.hold_s else ""
        return f"#{self.index} {self.kind}{on} {when} +{self.delay_s:.2f}s{held}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    max_steps: int
    every: int  # the run's checkpoint interval (steps)
    ranks: int
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    alone: tuple[str, ...] = ()  # kinds that land only on a run that trains again after the fault before them

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        raw = json.loads(text)
        faults = tuple(Fault(**f) for f in raw.pop("faults"))
        raw["alone"] = tuple(raw.get("alone", ()))
        unknown = sorted({f.kind for f in faults} - set(KINDS))
        if unknown:
            raise ValueError(f"schedule names fault kinds {unknown}; known: {sorted(KINDS)}")
        return cls(**raw, faults=faults)

    def save(self, path: Path) -> None:
        path.write_text(self.to_json() + "\n")

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out


def draw(seed: int, *, faults: int, max_steps: int, every: int, ranks: int = 2, overlap_p: float = 0.2,
         kinds: dict[str, Kind] | None = None, must: tuple[str, ...] = (), alone: tuple[str, ...] = ()) -> Schedule:
    """``faults`` faults: the ``must`` kinds (any of :data:`KINDS`) for sure, the rest drawn by weight from
    ``kinds`` (default :data:`KINDS`), their steps spread over the run after its first checkpoint and before its last
    interval (each at a step of its own, so that the run makes progress between them), a fault
    overlapping the one before with probability ``overlap_p``, but for a fault of the ``alone``
    kinds, which neither overlaps nor is overlapped, and lands (as the one after it does) only once
    the run trains again after the fault before it (the verdict then knows its recovery path for
    sure). Pure: the seed decides everything."""
    catalogue = kinds or KINDS
    unknown = sorted(set(must) - set(KINDS))
    if unknown or len(must) > faults:
        raise ValueError(f"must {list(must)}: unknown {unknown} or more than {faults} faults")
    rng = random.Random(seed)
    first, last = every + 1, max_steps - every
    if last - first + 1 < faults:
        raise ValueError(f"{faults} faults do not fit between steps {first} and {last} of a {max_steps}-step run")
    names = sorted(catalogue)
    drawn = list(must) + rng.choices(names, weights=[catalogue[n].weight for n in names], k=faults - len(must))
    rng.shuffle(drawn)
    steps = sorted(rng.sample(range(first, last + 1), faults))
    out = []
    for i, (kind, step) in enumerate(zip(drawn, steps, strict=True)):
        spec = KINDS[kind]
        overlap = i > 0 and rng.random() < overlap_p and kind not in alone and drawn[i - 1] not in alone
        target = rng.randrange(ranks) if spec.target in ("rank", "node") else 0
        hold = round(rng.uniform(*spec.hold), 2) if spec.hold != (0.0, 0.0) else 0.0
        delay = round(rng.uniform(0.0, 2.0 if overlap else 1.0), 2)
        out.append(Fault(i, kind, step, delay, overlap, target, hold))
    return Schedule(seed, max_steps, every, ranks, tuple(out), tuple(alone))
