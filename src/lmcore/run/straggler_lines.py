"""The ledger's ``straggler`` lines (written by lmtrain.health.straggler_watch): their words and
which ranks they say are slow now; and the parts of a step a rank's timing names
(lmtrain.observe.rank_timing). Pure; shared by the runtime and the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TIMING_PARTS = ("data", "forward", "backward", "optimizer", "boundary")  # a rank's step, between Lightning's hooks
PEERS = "peers"  # slower than the median of the ranks
SELF = "self"  # slower than its own earlier intervals


def describe(line: Mapping[str, Any]) -> str:
    """``rank 1 (n2) 1.8x the median compute`` (or ``... 1.8x its own earlier compute``)."""
    against = "the median compute" if line.get("against") == PEERS else "its own earlier compute"
    return f"rank {line.get('rank')} ({line.get('node')}) {line.get('factor')}x {against}"


def slow_ranks(ledger: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ranks of the newest attempt that its straggler lines say are slow now, slowest first."""
    starts = [e.get("attempt") for e in ledger if e.get("event") == "start"]
    if not starts:
        return []
    current: dict[Any, Mapping[str, Any]] = {}
    for e in ledger:
        if e.get("event") == "straggler" and e.get("attempt") == starts[-1]:
            current[e.get("rank")] = e
    slow = [dict(e) for e in current.values() if e.get("state") == "start"]
    return sorted(slow, key=lambda e: (-_number(e.get("factor")), _number(e.get("rank"))))


def _number(value: Any) -> float:
    """A line's number, 0 for anything else (a hand-edited or damaged line sorts last, never raises)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
