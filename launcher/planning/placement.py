"""Where the job's nodes sit in the network, planned: the spec's ``resources.placement`` against the
profile's ``network`` (lmcore.network), the sbatch options that ask SLURM for it, and the rank layout
the dry run shows (node slot -> ranks -> their pipeline stages and data-parallel replicas -> the
segment the node lies in). Pure.

Ranks fill the job's nodes in SLURM's order (block distribution: node k holds ranks
k x tasks_per_node ...), and the mesh is (data, pipeline, tensor) with tensor innermost
(lmcore.parallelism): a tensor-parallel group lies within a node, a pipeline's stages on
consecutive nodes, the data-parallel replicas cross last. SLURM lists a job's nodes in slurm.conf
order, in which sites number a rack's (a block's, a switch's) nodes together; a segment of
``group_nodes`` nodes inside one block therefore holds whole pipelines.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmcore.network import Network, Placement, Resolved, resolve_placement
from lmcore.plan import SlurmParams, Topology

OPTIONS = ("switches", "segment")  # the sbatch options a placement sets


def group_nodes(topo: Topology) -> int:
    """The nodes one model-parallel group (tensor x pipeline ranks) spans; 1 when it fits in a node."""
    par = topo.parallelism
    ranks = par.tensor * par.pipeline
    tpn = topo.tasks_per_node
    return -(-ranks // tpn) if ranks > tpn else 1


def plan_placement(placement: Placement, network: Network, topo: Topology, slurm: SlurmParams, *,
                   profile: str) -> tuple[SlurmParams, dict[str, Any] | None, list[str], list[str]]:
    """(the SLURM parameters with the placement's options, the plan's ``placement`` record, notes,
    problems). The record is None when the cluster has no topology and nothing was asked."""
    span = group_nodes(topo)
    got = resolve_placement(placement, network, slurm.nodes, group_nodes=span, profile=f"profile '{profile}'")
    if isinstance(got, str):
        return slurm, None, [], [got]
    problems = _conflicts(placement, network, got, slurm)
    if problems:
        return slurm, None, [], problems
    if network.topology == "none" and got.within == "any" and network.nvlink is None:
        return slurm, None, [], []
    options = {**slurm.site_options, **got.options}
    record = {
        "within": got.within, "why": got.why, "options": got.options, "segment": got.segment,
        "topology": network.topology, "groups": dict(network.groups), "group_nodes": span,
        "layout": layout_rows(topo, got.segment),
    }
    notes = [_note(got, network, slurm, span)]
    return dataclasses.replace(slurm, site_options=options), record, [n for n in notes if n], []


def _conflicts(placement: Placement, network: Network, got: Resolved, slurm: SlurmParams) -> list[str]:
    problems = [f"slurm.sbatch.{k} and resources.placement both ask SLURM where to place the nodes: keep one"
                for k in OPTIONS if k in slurm.site_options and k in got.options]
    if placement.max_wait is not None and "switches" not in got.options:
        problems.append(f"resources.placement.max_wait applies to topology/tree (sbatch --switches=1@WAIT); here "
                        f"({network.topology}, within: {got.within}) SLURM waits for the placement without a bound")
    return problems


def _note(got: Resolved, network: Network, slurm: SlurmParams, span: int) -> str:
    flags = " ".join(f"--{k}={v}" for k, v in got.options.items())
    if got.options:
        return f"resources.placement: {got.why} (sbatch {flags}); the job waits until SLURM can place it so"
    if network.topology != "none" and span > 1:
        where = "leaf switches" if network.topology == "tree" else "blocks"
        hint = "within: switch" if network.topology == "tree" else f"within: auto (segments of {span})"
        return (f"resources.placement: none asked; a model-parallel group spans {span} nodes and SLURM may put them "
                f"in different {where} ({hint} keeps each inside one)")
    return ""


def layout_rows(topo: Topology, segment: int | None) -> list[dict[str, Any]]:
    """One row per node slot (the k-th node SLURM gives the ranks): its ranks, their pipeline stages
    and data-parallel replicas, and the segment it lies in (None: no segments asked)."""
    par, tpn = topo.parallelism, topo.tasks_per_node
    rows = []
    for k in range(topo.nodes):
        ranks = range(k * tpn, (k + 1) * tpn)
        rows.append({
            "node": k, "ranks": [ranks.start, ranks.stop - 1],
            "stages": sorted({(r // par.tensor) % par.pipeline for r in ranks}),
            "replicas": sorted({par.data_rank(r) for r in ranks}),
            "segment": k // segment if segment else None,
        })
    return rows


def describe_layout(record: dict[str, Any]) -> list[str]:
    """The dry run's lines: node slot -> ranks -> stages and replicas -> segment."""
    lines = []
    for row in record.get("layout") or []:
        lo, hi = row["ranks"]
        where = f"  segment {row['segment']}" if row.get("segment") is not None else ""
        stages = ",".join(str(s) for s in row["stages"])
        replicas = ",".join(str(d) for d in row["replicas"])
        lines.append(f"node {row['node']}: ranks {lo}-{hi}  stage(s) {stages}  replica(s) {replicas}{where}")
    return lines
