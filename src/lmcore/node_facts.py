"""What `lmlaunch doctor --on-nodes` learns from each node, shared by the probe that measures it
(``lmtrain.health.node_probe``, on the allocation) and the judgements that read it (``launcher.doctor.nodes``,
on the login node); and how a ``*_SOCKET_IFNAME`` variable selects interfaces. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Each probe prints one line starting with this (srun --label prefixes it with the task id).
MARK = "LMLAUNCH_NODE_PROBE "
# The variables whose interfaces are checked on every node, and the syntax each takes.
IFNAME_VARS = {"NCCL_SOCKET_IFNAME": "nccl", "GLOO_SOCKET_IFNAME": "gloo"}


@dataclass(frozen=True)
class AllReduce:
    """One timed all-reduce over the whole allocation (every rank reports the same figures)."""

    backend: str  # gloo | nccl
    world_size: int
    bytes: int
    seconds: float | None  # per all-reduce, the mean of the timed ones
    busbw_gbps: float | None  # nccl-tests' bus bandwidth: 2(n-1)/n x bytes / seconds
    skipped: str | None = None  # why it did not run (one node, an interface missing ...)
    error: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    """One node's figures; a figure is None when its measurement failed (see ``errors``)."""

    node: str
    rank: int
    device: str  # "cpu (4 threads)" or "cuda: NVIDIA H100 80GB HBM3"
    gemm_gflops: float | None
    mem_gbps: float | None
    write_mbps: float | None
    write_path: str
    interfaces: tuple[str, ...]  # /sys/class/net on the node
    ifname_env: dict[str, str]  # the *_SOCKET_IFNAME variables the task saw
    allreduce: AllReduce | None = None
    errors: dict[str, str] = field(default_factory=dict)  # figure -> what went wrong

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeFacts:
        ar = d.get("allreduce")
        return cls(**{**d, "interfaces": tuple(d.get("interfaces", ())),
                      "allreduce": AllReduce(**ar) if isinstance(ar, dict) else None})


@dataclass(frozen=True)
class IfnameVerdict:
    """What one ``*_SOCKET_IFNAME`` value selects among a node's interfaces."""

    var: str
    value: str
    selected: tuple[str, ...]  # the interfaces the library would use
    missing: tuple[str, ...]  # listed names that match nothing (harmless for an exclusion list)
    ok: bool
    why: str


def select_interfaces(var: str, value: str, available: Sequence[str]) -> IfnameVerdict:
    """Apply ``var=value`` to ``available`` as the library reading it does.

    NCCL (``NCCL_SOCKET_IFNAME``): a comma list of name prefixes (``ib,eth``); a leading ``^``
    excludes the listed ones instead; a leading ``=`` (after ``^`` if both) makes the names exact
    (``=eth0``, ``^=docker0``). NCCL fails when nothing is selected and ignores a listed prefix that
    matches nothing as long as another one matches. Gloo (``GLOO_SOCKET_IFNAME``): a comma list of
    exact names, one device each; torch fails at the first name the node lacks.
    """
    text = value.strip()
    if IFNAME_VARS.get(var) == "gloo":
        names = tuple(n for n in (p.strip() for p in text.split(",")) if n)
        missing = tuple(n for n in names if n not in available)
        ok = bool(names) and not missing
        why = (f"{var}={value}: no such interface {', '.join(missing)} (the node has {', '.join(available) or 'none'})"
               if missing else f"{var}={value} names no interface" if not names else f"{var}={value}: present")
        return IfnameVerdict(var, value, tuple(n for n in names if n in available), missing, ok, why)
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = tuple(n for n in (p.strip() for p in text.split(",")) if n)

    def matches(iface: str, entry: str) -> bool:
        return iface == entry if exact else iface.startswith(entry)

    hit = {e: [i for i in available if matches(i, e)] for e in entries}
    missing = tuple(e for e, found in hit.items() if not found)
    if exclude:
        selected = tuple(i for i in available if not any(matches(i, e) for e in entries))
    else:
        selected = tuple(i for i in available if any(matches(i, e) for e in entries))
    kind = ("excludes" if exclude else "selects") + (" exactly" if exact else " by prefix")
    if not selected:
        why = (f"{var}={value} {kind} {', '.join(entries) or 'nothing'}: no interface of the node is left "
               f"(it has {', '.join(available) or 'none'})") if exclude else (
            f"{var}={value}: no interface matches {', '.join(missing) or value} (the node has "
            f"{', '.join(available) or 'none'})")
        return IfnameVerdict(var, value, (), missing, False, why)
    return IfnameVerdict(var, value, selected, missing, True, f"{var}={value} {kind}: {', '.join(selected)}")


def ifname_verdicts(env: Mapping[str, str], available: Sequence[str]) -> list[IfnameVerdict]:
    """Every ``*_SOCKET_IFNAME`` variable of ``env`` judged against ``available``."""
    return [select_interfaces(var, env[var], available) for var in IFNAME_VARS if env.get(var)]
