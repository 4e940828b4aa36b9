"""Which nodes a restart in place runs on: pure, no I/O (the policy's part for spare nodes).

A job with ``resources.spare_nodes: K`` holds K nodes beyond its ranks' (sbatch --nodes=N+K
--no-kill, srun --nodes=N). When an attempt fails, the nodes it points at are suspect: a node
SLURM set DOWN (it has left the allocation), the node whose rank died first in this attempt
and in the one before, or a straggler's node the attempt stopped for (health.stragglers.action
exclude). A restart in place leaves the suspects out (srun --exclude) and the ranks
run on the nodes left, the same world size, while the allocation still holds enough of them;
without a spare the job goes back to the queue (``policy._requeued``) as it did before spares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from lmcore.job.network import crossing_units


class EndFacts(Protocol):
    """What this module reads of the policy's facts (lmtrain.preemption.policy.EndFacts)."""

    nodes_down: list[str]
    first_death_node: str | None
    previous_first_death_node: str | None
    spare_nodes: int
    allocation_nodes: list[str] | None
    left_out: list[str]
    job_nodes: int
    slow_node: str | None
    attempt_nodes: list[str]
    node_groups: dict[str, str]
    unit_nodes: int


@dataclass(frozen=True)
class InPlace:
    """A restart in place: refused (why), or the nodes its ranks leave out and what changed."""

    refused: str | None = None
    leave_out: list[str] = field(default_factory=list)  # srun --exclude, every node this job left out so far
    why: str = ""  # the nodes newly left out and the spares that take their place ("" : none changed)
    hold_back: list[str] = field(default_factory=list)  # healthy spares kept idle this time (srun --exclude too)


def suspects(f: EndFacts) -> tuple[list[str], str]:
    """The nodes this attempt's failure points at, and why."""
    if f.slow_node is not None:
        return [f.slow_node], f"{f.slow_node} slow (health.stragglers)"
    if f.nodes_down:
        return sorted(set(f.nodes_down)), f"node {', '.join(sorted(set(f.nodes_down)))} DOWN"
    if f.first_death_node is not None and f.first_death_node == f.previous_first_death_node:
        return [f.first_death_node], f"the rank that died first died on {f.first_death_node} in the attempt before too"
    return [], ""


def spare_for(f: EndFacts) -> InPlace:
    """The nodes of the next restart in place, or why there is none here."""
    bad, why = suspects(f)
    kept_out = sorted(set(f.left_out))
    if not bad:  # the same nodes again (the spares held back before stay idle)
        return InPlace(leave_out=kept_out, hold_back=_idle(f, kept_out))
    if not f.spare_nodes:
        return InPlace(refused=f"{why}: the node is suspect, and the job has no spare (resources.spare_nodes) to "
                               f"take its place; a requeue lets SLURM place the job again")
    if f.allocation_nodes is None:
        return InPlace(refused=f"{why}: SLURM did not say which nodes the job still holds")
    out = sorted(set(kept_out) | set(bad))
    usable = [n for n in f.allocation_nodes if n not in out]
    if len(usable) < f.job_nodes:
        return InPlace(refused=f"{why}: no spare left (the job holds {len(usable)} usable node(s) "
                               f"{','.join(usable) or '-'} for ranks on {f.job_nodes}; "
                               f"{','.join(out)} left out)")
    run = choose_nodes(usable, f.job_nodes, f.attempt_nodes, f.node_groups, f.unit_nodes, bad)
    hold = [n for n in usable if n not in run]
    spares = len(usable) - f.job_nodes
    took = [n for n in run if n not in f.attempt_nodes]
    where = _where(took, bad, f.node_groups)
    moved = _crossing_note(run, f.node_groups, f.unit_nodes)
    return InPlace(leave_out=out, hold_back=hold if f.node_groups else [],
                   why=f"{why}: {', '.join(bad)} left out, a spare takes its place{where} ({spares} spare(s) left){moved}")


def _idle(f: EndFacts, kept_out: list[str]) -> list[str]:
    """With groups, the allocation's usable nodes the attempt did not run on: held back again, so that
    srun (which takes the first usable nodes) runs the ranks where they were."""
    if not f.node_groups or f.allocation_nodes is None:
        return []
    usable = [n for n in f.allocation_nodes if n not in kept_out]
    on = [n for n in usable if n in f.attempt_nodes]
    return [n for n in usable if n not in on] if len(on) == f.job_nodes else []


def _where(took: list[str], bad: list[str], groups: dict[str, str]) -> str:
    """Which spares took the place and whether they are of the failed nodes' group."""
    if not groups or not took:
        return ""
    failed = {groups[n] for n in bad if n in groups}
    same = [n for n in took if groups.get(n) in failed]
    other = [f"{n} of {groups.get(n, '?')}" for n in took if n not in same]
    said = [f"{n} of the same {'/'.join(sorted(failed))}" for n in same] + other
    return f" ({', '.join(said)})" if said else ""


def _crossing_note(run: list[str], groups: dict[str, str], unit: int) -> str:
    crossing = crossing_units(run, groups, unit)
    if not crossing:
        return ""
    return ("; no switch or block holds the whole of " + ", ".join("+".join(u) for u in crossing)
            + " any more: those ranks' model-parallel group crosses one")


def choose_nodes(usable: list[str], need: int, current: list[str], groups: dict[str, str], unit: int,
                 failed: list[str]) -> list[str]:
    """The ``need`` nodes of ``usable`` (SLURM's order) a restart in place runs on: the attempt's
    nodes that are left, and spares from the failed nodes' switch or block first; where that
    breaks a model-parallel unit (``unit`` consecutive nodes) across groups and whole groups can
    hold every unit instead, the ranks move to those. Without groups: SLURM's choice, the first
    ``need`` usable nodes."""
    if not groups:
        return usable[:need]
    order = {n: i for i, n in enumerate(usable)}
    kept = [n for n in current if n in order]
    failed_groups = {groups[n] for n in failed if n in groups}
    spares = sorted((n for n in usable if n not in kept), key=lambda n: (groups.get(n) not in failed_groups, order[n]))
    simple = sorted(kept + spares[:max(0, need - len(kept))], key=order.__getitem__)[:need]
    if unit <= 1 or not crossing_units(simple, groups, unit):
        return simple
    packed = _packed(usable, need, groups, unit)
    return packed if len(crossing_units(packed, groups, unit)) < len(crossing_units(simple, groups, unit)) else simple


def _packed(usable: list[str], need: int, groups: dict[str, str], unit: int) -> list[str]:
    """Whole units inside groups first (groups in SLURM's order), then what is left."""
    chosen: list[str] = []
    for g in dict.fromkeys(groups[n] for n in usable if n in groups):  # a node of no group holds no whole unit
        members = [n for n in usable if groups.get(n) == g]
        whole = members[:len(members) // unit * unit]
        chosen += whole[:max(0, need - len(chosen))]
    chosen += [n for n in usable if n not in chosen][:max(0, need - len(chosen))]
    order = {n: i for i, n in enumerate(usable)}
    return sorted(chosen, key=order.__getitem__)
