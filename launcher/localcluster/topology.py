"""`cluster up --topology tree:2x2 | block:2 | none`: the local cluster's network, as SLURM's
topology plugins see one (pure: parsing the option and rendering topology.conf).

``tree:GxN`` is G leaf switches of N nodes each under one top switch (topology/tree, every SLURM
version); ``block:GxN`` is G blocks of N nodes (topology/block, SLURM 23.11 and later). ``KIND:N``
alone cuts the cluster's ``--nodes`` into groups of N. Nodes are given to the groups in order
(n1, n2 to the first), as racks are numbered on most sites.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmcore.slurm import versions

KINDS = {"tree": "topology/tree", "block": "topology/block"}
_SYNTAX = re.compile(r"(tree|block):(?:(\d+)x)?(\d+)")
USAGE = "tree:GxN (G leaf switches of N nodes), block:GxN (G blocks of N nodes), KIND:N (groups of N) or none"


@dataclass(frozen=True)
class LocalTopology:
    kind: str  # "tree" | "block"
    groups: int
    per_group: int

    @property
    def nodes(self) -> int:
        return self.groups * self.per_group

    @property
    def plugin(self) -> str:
        return KINDS[self.kind]

    @property
    def text(self) -> str:
        return f"{self.kind}:{self.groups}x{self.per_group}"

    def group_names(self) -> tuple[str, ...]:
        prefix = "s" if self.kind == "tree" else "b"
        return tuple(f"{prefix}{g}" for g in range(1, self.groups + 1))

    def members(self, node_names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
        """Each group's nodes, in order."""
        n = self.per_group
        return {name: node_names[g * n:(g + 1) * n] for g, name in enumerate(self.group_names())}

    def block_sizes(self) -> tuple[int, ...]:
        """BlockSizes: the base block, then each power-of-two aggregate of blocks up to all of them
        (topology.conf(5): successive sizes are a power of two larger than the prior)."""
        sizes, size = [self.per_group], self.per_group * 2
        while size <= self.nodes:
            sizes.append(size)
            size *= 2
        return tuple(sizes)

    def render(self, node_names: tuple[str, ...]) -> str:
        """topology.conf for these nodes (the cluster's, n1..nN)."""
        from hostlist import collect_hostlist  # n1,n2,n3 -> n[1-3], as sites write them

        lines = ["# Written by `lmlaunch cluster up --topology " + self.text + "` (launcher/localcluster/topology.py)."]
        members = self.members(node_names)
        if self.kind == "tree":
            lines += [f"SwitchName={name} Nodes={collect_hostlist(list(nodes))}" for name, nodes in members.items()]
            lines.append(f"SwitchName=top Switches={','.join(members)}")
        else:
            lines += [f"BlockName={name} Nodes={collect_hostlist(list(nodes))}" for name, nodes in members.items()]
            lines.append("BlockSizes=" + ",".join(str(s) for s in self.block_sizes()))
        return "\n".join(lines) + "\n"


def parse(text: str | None, nodes: int | None) -> LocalTopology | None:
    """``--topology TEXT`` for a cluster of ``nodes`` nodes (None: the count the topology implies).
    None for ``none``. Raises ValueError naming what is allowed."""
    if text is None or text.strip().lower() in ("", "none", "flat"):
        return None
    m = _SYNTAX.fullmatch(text.strip().lower())
    if not m:
        raise ValueError(f"--topology {text!r}: expected {USAGE}")
    kind, groups, per = m.group(1), m.group(2), int(m.group(3))
    if per < 1:
        raise ValueError(f"--topology {text!r}: a group holds at least one node")
    if groups is None:
        if nodes is None:
            raise ValueError(f"--topology {text!r}: say the groups (e.g. {kind}:2x{per}) or --nodes")
        if nodes % per:
            raise ValueError(f"--topology {text!r}: {nodes} nodes do not cut into groups of {per}")
        return LocalTopology(kind, nodes // per, per)
    topo = LocalTopology(kind, int(groups), per)
    if topo.groups < 1:
        raise ValueError(f"--topology {text!r}: at least one group")
    if nodes is not None and nodes != topo.nodes:
        raise ValueError(f"--topology {text!r} has {topo.nodes} nodes but --nodes is {nodes}")
    return topo


def version_problem(topo: LocalTopology, version: str | None) -> str | None:
    """Why SLURM ``version`` ("22.05") cannot run ``topo`` (None: it can, or the version is unknown);
    which release runs which plugin is lmcore.slurm.versions' table."""
    known = versions.facts(version)
    if known is None or topo.kind in known.topologies:
        return None
    others = versions.with_topology(topo.kind)
    return (f"--topology {topo.text}: SLURM {version} has no topology/{topo.kind} plugin (of the tested releases, "
            f"{', '.join(others)} have it); use tree:{topo.groups}x{topo.per_group}"
            + "".join(f", or {topo.kind} on the {v} cluster (--slurm {v})" for v in others[:1]))
