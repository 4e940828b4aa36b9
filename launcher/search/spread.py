"""A sweep over several clusters (the spec's ``clusters``, or ``--cluster a,b``): which cluster runs
which points, and how many of them at once. Pure: the clusters' answers come from
launcher.submit.start_estimates, the submission is launcher.commands.sweep's.

Each cluster that would take a point gets an array of its own. The points are dealt round-robin,
soonest-starting cluster first, to as many clusters as ``max_parallel`` allows (a cluster that could
run none at once gets none); ``max_parallel`` is split between them, the soonest getting the rest,
so that at most ``max_parallel`` points run at once in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from launcher.planning.clusters import Answer


@dataclass(frozen=True)
class Share:
    cluster: str
    points: list[int]  # the sweep's point indices this cluster's array runs
    max_parallel: int  # its array's %N


def spread(n_points: int, answers: Sequence[Answer], max_parallel: int) -> list[Share]:
    """The points dealt to the clusters that would take one (none: an empty list)."""
    order = {a.cluster: i for i, a in enumerate(answers)}
    taking = sorted((a for a in answers if a.answered and a.accepted),
                    key=lambda a: (a.start if a.start is not None else math.inf, order[a.cluster]))
    used = taking[:max(0, min(len(taking), max_parallel, n_points))]
    if not used:
        return []
    points: list[list[int]] = [[] for _ in used]
    for i in range(n_points):
        points[i % len(used)].append(i)
    base, extra = divmod(max_parallel, len(used))
    return [Share(a.cluster, pts, min(len(pts), base + (1 if k < extra else 0)))
            for k, (a, pts) in enumerate(zip(used, points))]
