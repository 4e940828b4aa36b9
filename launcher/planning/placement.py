"""Where the job's nodes sit in the network, planned: the spec's ``resources.placement`` against the
profile's ``network`` (lmcore.job.network), the sbatch options that ask SLURM for it, and the rank layout
the dry run shows (node slot -> ranks -> their pipeline stages and data-parallel replicas -> the
segment the node lies in). Pure.

Ranks fill the job's nodes in SLURM's order (block distribution: node k holds ranks
k x tasks_per_node ...), and the mesh is (data, pipeline, tensor) with tensor innermost
(lmcore.job.parallelism): a tensor-parallel group lies within a node, a pipeline's stages on
consecutive nodes, the data-parallel replicas cross last. SLURM lists a job's nodes in slurm.conf
order, in which sites number a rack's (a block's, a switch's) nodes together; a segment of
``group_nodes`` nodes inside one block therefore holds whole pipelines.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lmcore.job.network import Network, Placement, Resolved, resolve_placement
from lmcore.job.plan import SlurmParams, Topology

OPTIONS = ("switches", "segment")  # the sbatch options a placement sets


def group_nodes(topo: Topology) -> int:
    """The nodes that hold whole model-parallel groups (tensor x pipeline ranks): 1 when the groups
    fit nodes exactly, 2 for a group of 8 ranks on nodes of 4, 3 for groups of 3 on nodes of 4
    (ranks 3-5 straddle nodes 0 and 1; three nodes hold four whole groups)."""
    par = topo.parallelism
    ranks, tpn = par.tensor * par.pipeline, topo.tasks_per_node
    return math.lcm(ranks, tpn) // tpn  # the fewest whole nodes that hold whole groups


@dataclass
class PlacementPlan:
    """What the network adds to a plan."""

    slurm: SlurmParams  # with the placement's sbatch options
    record: dict[str, Any] | None = None  # the plan's ``placement`` (None: no topology and nothing asked)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    env: dict[str, tuple[str, str]] = field(default_factory=dict)  # NCCL for the network: name -> (value, why)
    rank_env: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"by_gpu": [...], "by_local_rank": [...], "why"}


def plan_placement(placement: Placement, network: Network, topo: Topology, slurm: SlurmParams, *,
                   profile: str) -> PlacementPlan:
    """The SLURM options, the plan's ``placement`` record, the notes and the NCCL environment the
    network calls for, or the problems that refuse the spec."""
    span = group_nodes(topo)
    got = resolve_placement(placement, network, slurm.nodes, group_nodes=span, profile=f"profile '{profile}'")
    if isinstance(got, str):
        return PlacementPlan(slurm, problems=[got])
    problems = _conflicts(placement, network, got, slurm) + _hca_problems(network, topo, profile, slurm.gpus_per_node > 0)
    if problems:
        return PlacementPlan(slurm, problems=problems)
    env, rank_env = nccl_for_network(network, got, topo, gpus=slurm.gpus_per_node > 0)
    if network.topology == "none" and got.within == "any" and network.nvlink is None:
        return PlacementPlan(slurm, env=env, rank_env=rank_env)
    record = {
        "within": got.within, "why": got.why, "options": got.options, "segment": got.segment,
        "topology": network.topology, "groups": dict(network.groups), "group_nodes": span,
        "layout": layout_rows(topo, got.segment),
    }
    note = _note(got, network, slurm, span)
    return PlacementPlan(dataclasses.replace(slurm, site_options={**slurm.site_options, **got.options}), record,
                         [note] if note else [], env=env, rank_env=rank_env)


def merge_env(placed: PlacementPlan, values: dict[str, str], reasons: dict[str, str]) -> list[str]:
    """The network's NCCL variables into the task environment, where the profile's env and the
    job's env.vars do not set them already (theirs win, said in a note)."""
    notes = []
    for name, (value, why) in placed.env.items():
        if name in values:
            notes.append(f"{name}={values[name]} as set ({reasons.get(name, '')}), not the network's {value}")
            continue
        values[name], reasons[name] = value, why
    for name in [n for n in placed.rank_env if n in values]:
        del placed.rank_env[name]
        notes.append(f"{name}={values[name]} on every rank as set ({reasons.get(name, '')}), not network.hca_by_gpu's "
                     "HCA per rank")
    return notes


def _hca_problems(network: Network, topo: Topology, profile: str, gpus: bool) -> list[str]:
    if network.hca_by_gpu and gpus and topo.tasks_per_node > len(network.hca_by_gpu):
        return [f"profile '{profile}' network.hca_by_gpu names {len(network.hca_by_gpu)} HCA(s), the job runs "
                f"{topo.tasks_per_node} GPU ranks per node: name the HCA of every GPU"]
    return []


def nccl_for_network(network: Network, got: Resolved, topo: Topology, *, gpus: bool
                     ) -> tuple[dict[str, tuple[str, str]], dict[str, dict[str, Any]]]:
    """NCCL's variables for the profile's network (jobs that ask SLURM for GPUs, simulated ones
    included: each rank's variables are set by the GPU it got all the same; nothing where the profile
    says nothing): each rank's own HCA, multi-node NVLink inside one domain."""
    env: dict[str, tuple[str, str]] = {}
    rank_env: dict[str, dict[str, Any]] = {}
    if not gpus:
        return env, rank_env
    if network.hca_by_gpu:
        hcas = [f"={h}" for h in network.hca_by_gpu]
        rank_env["NCCL_IB_HCA"] = {"by_gpu": hcas, "by_local_rank": hcas[:topo.tasks_per_node], "why": (
            "each rank uses the HCA nearest the GPU SLURM gave it (network.hca_by_gpu, by the GPU's index on the "
            "node; by local rank where a rank cannot tell its GPU; '=' matches the name exactly, so mlx5_1 is not "
            "mlx5_10)")}
    if got.within == "nvlink" and topo.nodes > 1:  # one block that is one domain (lmcore.job.network._nvlink)
        env["NCCL_MNNVL_ENABLE"] = ("1", "the job's nodes are one NVLink domain (resources.placement.within: nvlink): "
                                         "NCCL uses multi-node NVLink between them, and fails rather than falling back "
                                         "to the network")
    return env, rank_env


def _conflicts(placement: Placement, network: Network, got: Resolved, slurm: SlurmParams) -> list[str]:
    problems = [f"slurm.sbatch.{k} and resources.placement both ask SLURM where to place the nodes: keep one"
                for k in OPTIONS if k in slurm.site_options and k in got.options]
    if placement.max_wait is not None and not got.options:
        problems.append(f"resources.placement.max_wait: nothing to wait for (within: {got.within} asks SLURM for no placement)")
    elif placement.max_wait is not None and "switches" not in got.options:
        problems.append(f"resources.placement.max_wait applies to topology/tree (sbatch --switches=N@WAIT); here "
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
