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


@dataclass(frozen=True)
class InPlace:
    """A restart in place: refused (why), or the nodes its ranks leave out and what changed."""

    refused: str | None = None
    leave_out: list[str] = field(default_factory=list)  # srun --exclude, every node this job left out so far
    why: str = ""  # the nodes newly left out and the spares that take their place ("" : none changed)


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
    if not bad:
        return InPlace(leave_out=kept_out)
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
    spares = len(usable) - f.job_nodes
    return InPlace(leave_out=out, why=f"{why}: {', '.join(bad)} left out, a spare takes its place "
                                      f"({spares} spare(s) left)")
