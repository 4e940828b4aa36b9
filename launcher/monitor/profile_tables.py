"""``lmlaunch profile RUN``, the pure parts: which ranks a user asked to profile, and the ranks'
top-operator tables (lmtrain.observe.profiling writes them) printed side by side."""

from __future__ import annotations

from typing import Any

from lmcore.errors import UserError

MAX_STEPS = 1000  # lmtrain.observe.profiling.MAX_STEPS (the spec's profile.steps bound too)


def parse_ranks(text: str | None, world: int) -> list[int] | None:
    """``--ranks`` as a sorted list (None: every rank); a clear error for anything else."""
    if text is None:
        return None
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--ranks {text!r}: give global ranks as numbers, e.g. --ranks 0,1") from None
    if not ranks:
        raise UserError("--ranks: give at least one rank, e.g. --ranks 0")
    outside = [r for r in ranks if r < 0 or r >= world]
    if outside:
        raise UserError(f"--ranks: rank {outside[0]} is not a rank of this job: its ranks are 0..{world - 1}")
    return ranks


def side_by_side(tables: list[dict[str, Any]], top: int) -> str:
    """The ranks' top operators by self time, one column pair (operator, ms) per rank."""
    width = 34
    head = "  ".join(f"{'rank ' + str(t['rank']) + ' (' + str(t['node']) + ')':<{width}}{'self ms':>9}" for t in tables)
    steps = tables[0]
    lines = [f"top operators by self time, steps {steps['from_step']}-{steps['to_step']}:", head]
    for i in range(top):
        cells = []
        for t in tables:
            ops = t.get("ops") or []
            if i < len(ops):
                name = ops[i]["name"] if len(ops[i]["name"]) <= width - 1 else ops[i]["name"][:width - 2] + "…"
                cells.append(f"{name:<{width}}{ops[i]['self_s'] * 1e3:>9.1f}")
            else:
                cells.append(" " * (width + 9))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
