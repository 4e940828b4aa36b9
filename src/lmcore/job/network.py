"""The cluster's network and where a job's nodes sit in it: the one owner of the topology concept.

A cluster profile's ``network`` section (:class:`Network`) says what SLURM's topology plugin knows
(``topology/tree``: leaf switches; ``topology/block``: base blocks and the block sizes; read off the
live cluster by `lmlaunch profile init`) and what SLURM cannot know (the multi-node NVLink domains
of a GB200/GB300 rack, the InfiniBand/RoCE HCA beside each GPU). A job spec's
``resources.placement`` (:class:`Placement`) asks for its nodes inside one switch or block, or in
segments of N nodes that each lie inside one block.

Pure: the planner asks :func:`resolve_placement` for the SLURM options (or why the placement can
never be satisfied); the tasks, the policy and status name a node's group with :func:`group_of_node`
and find the model-parallel units that cross groups with :func:`crossing_units`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from hostlist import expand_hostlist  # SLURM hostlist notation: n[1-3,7]
from pydantic import Field, field_validator, model_validator

from lmcore.job.strict_model import StrictModel
from lmcore.slurm.client import parse_duration

_GROUP_NAME = re.compile(r"[A-Za-z0-9_.\[\],-]{1,64}")
_HCA = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # lmlaunch writes NCCL's exact-match '=' itself


def _hostlist(value: str, what: str) -> tuple[str, ...]:
    try:
        nodes = tuple(expand_hostlist(value))
    except Exception as exc:  # hostlist.BadHostlist, and what its parser raises on odd input
        raise ValueError(f"{what}: {value!r} is not a SLURM hostlist such as n[1-4] ({exc})") from None
    if not nodes:
        raise ValueError(f"{what}: names no node")
    return nodes


class NvlinkDomains(StrictModel):
    """Multi-node NVLink domains (GB200/GB300 NVL72 racks): nodes whose GPUs reach each other over NVLink, which SLURM does not know."""

    nodes_per_domain: int = Field(..., ge=1, le=1024)
    """Nodes in one NVLink domain (NVL72 with 4 GPUs a node: 18)."""
    domains: dict[str, str] = Field(default_factory=dict, max_length=10000)
    """Each domain's nodes as a SLURM hostlist, by name (absent: the profile's blocks or leaf switches are the domains)."""

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: dict[str, str]) -> dict[str, str]:
        for name, nodes in v.items():
            if not _GROUP_NAME.fullmatch(name):
                raise ValueError(f"domains: {name!r} is not a name (letters, digits, _ . - [ ] ,)")
            _hostlist(nodes, f"domains.{name}")
        return v


class Network(StrictModel):
    """The cluster's network: SLURM's topology (read by `lmlaunch profile init`) and what SLURM does not know."""

    topology: Literal["tree", "block", "none"] = "none"
    """SLURM's TopologyPlugin: tree (leaf switches, sbatch --switches), block (blocks, sbatch --segment; SLURM 23.11+) or none."""
    groups: dict[str, str] = Field(default_factory=dict, max_length=100000)
    """Leaf switches (tree) or base blocks (block) by name, each its nodes as a SLURM hostlist (scontrol show topology)."""
    block_sizes: list[int] = Field(default_factory=list, max_length=16)
    """topology/block's BlockSizes: the base block's node count, then the larger sizes SLURM enforces."""
    nvlink: NvlinkDomains | None = None
    """Multi-node NVLink domains; jobs with tensor parallelism over nodes need one domain."""
    hca_by_gpu: list[str] = Field(default_factory=list, max_length=64)
    """The InfiniBand/RoCE HCA nearest each GPU, by local GPU index (e.g. mlx5_0 .. mlx5_7): each rank's NCCL_IB_HCA."""

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: dict[str, str]) -> dict[str, str]:
        seen: dict[str, str] = {}
        for name, nodes in v.items():
            if not _GROUP_NAME.fullmatch(name):
                raise ValueError(f"groups: {name!r} is not a switch or block name (letters, digits, _ . - [ ] ,)")
            for node in _hostlist(nodes, f"groups.{name}"):
                if node in seen:
                    raise ValueError(f"groups: node {node} is in both {seen[node]} and {name}")
                seen[node] = name
        return v

    @field_validator("hca_by_gpu")
    @classmethod
    def _hcas(cls, v: list[str]) -> list[str]:
        for hca in v:
            if not _HCA.fullmatch(hca):
                raise ValueError(f"hca_by_gpu: {hca!r} is not an HCA name such as mlx5_0 or mlx5_0:1")
        return v

    @model_validator(mode="after")
    def _kind(self) -> Network:
        if self.topology == "none" and self.groups:
            raise ValueError("groups are given but topology is none: say topology: tree (switches) or block")
        if self.topology != "none" and not self.groups:
            raise ValueError(f"topology {self.topology} needs its groups (the {self.group_word}s and their nodes)")
        if self.block_sizes and self.topology != "block":
            raise ValueError("block_sizes belong to topology: block")
        sizes = self.block_sizes
        if any(size < 1 for size in sizes):
            raise ValueError(f"block_sizes {sizes}: a block holds at least one node")
        if any(b <= a or b % a or (b // a) & (b // a - 1) for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"block_sizes {sizes}: each must be a power of two times the one before (topology.conf(5))")
        return self

    # -- what it says ---------------------------------------------------------------------------

    @property
    def group_word(self) -> str:
        return {"tree": "switch", "block": "block"}.get(self.topology, "group")

    def members(self) -> dict[str, tuple[str, ...]]:
        """Each group's nodes, expanded."""
        return {name: tuple(expand_hostlist(nodes)) for name, nodes in self.groups.items()}


    def largest_group(self) -> tuple[str, int] | None:
        sizes = {name: len(nodes) for name, nodes in self.members().items()}
        return max(sizes.items(), key=lambda kv: kv[1]) if sizes else None

    @property
    def base_block(self) -> int | None:
        """topology/block's planning base block size: BlockSizes' first, else the smallest block."""
        if self.topology != "block":
            return None
        if self.block_sizes:
            return self.block_sizes[0]
        return min(len(n) for n in self.members().values())



class Placement(StrictModel):
    """Where the job's nodes must sit in the network (the profile's `network`); SLURM is asked for it and waits for it."""

    within: Literal["auto", "switch", "block", "nvlink", "any"] = "any"
    """switch: all nodes under one leaf switch (topology/tree, sbatch --switches=1); block: all inside one block (topology/block, sbatch --segment=<nodes>); nvlink: inside one NVLink domain of the profile; auto: the profile's kind when the job fits one, else any; any: wherever SLURM puts it."""
    segment: int | None = Field(None, ge=1, le=4096)
    """topology/block: the nodes in segments of this many, each inside one block (sbatch --segment); a divisor of the job's nodes, at most the base block. Default with within: auto and model-parallel groups over nodes: the nodes of one such group."""
    max_wait: str | int | None = None
    """How long the job may wait for the placement before SLURM places it anyway (topology/tree: --switches=1@max_wait; SLURM caps it at SchedulerParameters=max_switch_wait, 300 s by default). Absent: SLURM's max_switch_wait."""

    @field_validator("max_wait", mode="before")
    @classmethod
    def _wait(cls, v: object) -> object:
        if v is None:
            return v
        seconds = None if isinstance(v, bool) or not isinstance(v, (str, int)) else parse_duration(str(v))
        if not seconds or seconds <= 0:
            raise ValueError(f"max_wait {v!r} is not a SLURM time (MM, MM:SS, HH:MM:SS, D-HH:MM)")
        return str(v)


@dataclass(frozen=True)
class Resolved:
    """What the placement asks of SLURM, and why (the dry run says it)."""

    within: str  # switch | block | nvlink | any, after auto
    options: dict[str, str]  # sbatch option -> value (switches, segment)
    why: str
    segment: int | None = None  # nodes per segment (each inside one block)


def resolve_placement(p: Placement, net: Network, nodes: int, *, group_nodes: int = 1,
                      profile: str = "the profile") -> Resolved | str:
    """The SLURM options for ``p`` on ``net`` for a job of ``nodes`` nodes (spares included), or why
    it can never be satisfied (naming the key and the numbers). ``group_nodes``: the nodes one
    model-parallel group (tensor x pipeline) spans, which ``within: auto`` keeps inside one block."""
    within: str = p.within
    if within == "auto":  # an explicit segment under auto: segments, whatever else auto would pick
        within = "any" if p.segment is not None else _auto(net, nodes, group_nodes)
    if p.segment is not None and net.topology != "block":
        return (f"resources.placement.segment({p.segment}) needs a topology/block cluster; {profile} has network "
                f"topology {net.topology}")
    if within == "any":
        if net.topology == "block":
            return _segments(p, net, nodes, group_nodes, "any")
        if net.topology == "tree" and p.within == "auto":
            return _fewest_switches(p, net, nodes, group_nodes)
        return Resolved("any", {}, "no placement asked")
    if within == "nvlink":
        if p.segment is not None:
            return (f"resources.placement.segment({p.segment}) with within: nvlink: one NVLink domain is one segment "
                    "of all the nodes; give one of the two")
        return _nvlink(net, nodes, profile)
    kind = {"switch": "tree", "block": "block"}[within]
    if net.topology == "none":
        return (f"resources.placement.within: {within} needs the cluster's topology; {profile} has no network.topology "
                "(`lmlaunch profile init` reads it off the cluster)")
    if net.topology != kind:
        other = {"tree": "switch", "block": "block"}[net.topology]
        return (f"resources.placement.within: {within} needs topology/{kind}; {profile} has network topology "
                f"{net.topology} (use within: {other} or auto)")
    if p.segment is not None:
        return (f"resources.placement.segment({p.segment}) with within: {within}: one {net.group_word} is one segment "
                "of all the nodes; give one of the two")
    biggest = _biggest(net)
    if nodes > biggest[1]:
        return (f"resources.placement.within: {within}: the job's {nodes} nodes never fit in one {net.group_word} of "
                f"{profile} (the largest, {biggest[0]}, has {biggest[1]})")
    if kind == "tree":
        wait = f"@{p.max_wait}" if p.max_wait is not None else ""
        return Resolved("switch", {"switches": f"1{wait}"}, f"all {nodes} nodes under one leaf switch (topology/tree)")
    base = net.base_block or nodes
    if nodes > base:
        return (f"resources.placement.within: block: the job's {nodes} nodes are more than the base block of "
                f"{profile} ({base} nodes; SLURM's --segment is at most the base block)")
    return Resolved("block", {"segment": str(nodes)}, f"all {nodes} nodes inside one block (topology/block --segment={nodes})", nodes)


def _biggest(net: Network) -> tuple[str, int]:
    return net.largest_group() or ("none", 0)


def _auto(net: Network, nodes: int, group_nodes: int) -> str:
    if net.topology == "none":  # SLURM cannot be asked for anything (an NVLink domain needs blocks)
        return "any"
    fits = nodes <= _biggest(net)[1] and (net.topology == "tree" or nodes <= (net.base_block or nodes))
    return ("switch" if net.topology == "tree" else "block") if fits else "any"


def _fewest_switches(p: Placement, net: Network, nodes: int, group_nodes: int) -> Resolved:
    """topology/tree for a job larger than a leaf switch: the fewest switches that hold it, so that
    each model-parallel group lies under one when the switches hold whole groups."""
    size = min(len(n) for n in net.members().values())
    if group_nodes > 1 and size % group_nodes:
        return Resolved("any", {}, f"no placement asked: a model-parallel group of {group_nodes} nodes does not "
                                   f"divide a leaf switch of {size}")
    count = -(-nodes // size)
    wait = f"@{p.max_wait}" if p.max_wait is not None else ""
    return Resolved("switches", {"switches": f"{count}{wait}"},
                    f"the {nodes} nodes under the fewest leaf switches ({count} of {size} nodes)")


def _segments(p: Placement, net: Network, nodes: int, group_nodes: int, within: str) -> Resolved | str:
    """topology/block for a job across blocks: segments that each lie inside one block."""
    base = net.base_block or 1
    seg = p.segment
    if seg is None and p.within == "auto" and 1 < group_nodes <= base and nodes % group_nodes == 0:
        seg = group_nodes
    if seg is None:
        return Resolved(within, {}, "no placement asked")
    if nodes % seg:
        return f"resources.placement.segment({seg}) must divide the job's {nodes} nodes (sbatch --segment)"
    if seg > base:
        return f"resources.placement.segment({seg}) is larger than the base block ({base} nodes) of the cluster's topology/block"
    return Resolved("segments", {"segment": str(seg)}, f"{nodes // seg} segment(s) of {seg} node(s), each inside one block", seg)


def _nvlink(net: Network, nodes: int, profile: str) -> Resolved | str:
    """One NVLink domain, asked of SLURM as one block (--segment=<nodes>): only topology/block
    guarantees it (topology/tree's --switches is a preference SLURM drops after max_switch_wait,
    and NCCL_MNNVL_ENABLE=1 then fails the job)."""
    key = "resources.placement.within: nvlink"
    if net.nvlink is None:
        return f"{key} needs network.nvlink in {profile} (the nodes of one NVLink domain)"
    if nodes > net.nvlink.nodes_per_domain:
        return (f"{key}: the job's {nodes} nodes never fit in one NVLink domain of {profile} "
                f"({net.nvlink.nodes_per_domain} nodes)")
    if net.topology != "block":
        return (f"{key} needs topology/block whose blocks are the NVLink domains; {profile} has network topology "
                f"{net.topology} (SLURM cannot be asked to keep a job inside one domain there)")
    if net.nvlink.domains:
        blocks = {frozenset(n) for n in net.members().values()}
        odd = [d for d, hosts in net.nvlink.domains.items() if frozenset(expand_hostlist(hosts)) not in blocks]
        if odd:
            return (f"{key}: network.nvlink.domains {', '.join(sorted(odd))} of {profile} are not blocks of its "
                    "topology, and SLURM places by blocks")
    base = net.base_block or nodes
    if nodes > base:
        return (f"{key}: the job's {nodes} nodes are more than the base block of {profile} ({base} nodes); SLURM's "
                "--segment, which keeps them in one block, is at most the base block")
    return Resolved("nvlink", {"segment": str(nodes)}, f"one NVLink domain: one block (--segment={nodes})", nodes)


def group_of_node(groups: dict[str, str], node: str) -> str | None:
    """``node``'s group in a plan's placement record (name -> hostlist)."""
    return next((g for g, nodes in groups.items() if node in expand_hostlist(nodes)), None)


def groups_by_node(groups: dict[str, str]) -> dict[str, str]:
    """node -> its group, every group's hostlist expanded once (for many nodes at a time)."""
    return {n: g for g, nodes in groups.items() for n in expand_hostlist(nodes)}


def crossing_units(run: list[str], groups: dict[str, str], unit: int) -> list[list[str]]:
    """The model-parallel units (``unit`` consecutive nodes in SLURM's order) that span groups."""
    if unit <= 1 or not groups:
        return []
    units = [run[i:i + unit] for i in range(0, len(run), unit)]
    return [u for u in units if len({groups.get(n) or f"?{n}" for n in u}) > 1]  # a node of no group: its own
