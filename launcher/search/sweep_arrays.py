"""A sweep's arrays put on the clusters: one array per cluster (one in all for a sweep on one
cluster), each through its profile's way to SLURM, chained where the cluster's MaxArraySize splits
it. All or nothing: the points' run directories are opened first, and on any failure the arrays
already queued (on any cluster) are cancelled and every opened run directory is rolled back."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.planning import transport
from launcher.planning.clusters import plan_each
from launcher.planning.resolve import Resolved
from launcher.runs import registry as runs
from launcher.search.array import submit_array
from launcher.search.spread import Share, spread
from launcher.spec.profiles import load_profile
from launcher.submit import lifecycle
from launcher.submit.arrays import max_array_size, submit_chained
from launcher.submit.start_estimates import ask_each, describe
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.job.plan import LaunchPlan
from lmcore.slurm import client as slurm


@dataclass(frozen=True)
class Group:
    """One array: its cluster (None: the sweep's one cluster), its points and its %N."""

    cluster: str | None
    points: list[int]
    max_parallel: int

    def folder(self, sweep_dir: Path) -> Path:
        """Its submitit folder's parent: the sweep directory, or a cluster's own beside the others
        (two clusters' job ids may be the same numbers)."""
        return sweep_dir if self.cluster is None else sweep_dir / f"on-{self.cluster}"


def spread_over(first: Resolved, spec: str, overrides: Sequence[str], n_points: int, max_parallel: int,
                environ: Mapping[str, str] | None, python: str | None, *, force: bool) -> tuple[list[Group], list[str]]:
    """A sweep whose spec names several clusters: the first point planned on each (each must be
    able to run it), each asked when it would start, the points dealt (launcher.search.spread);
    the groups and what the clusters said."""
    assert first.spec.clusters
    plans = plan_each(spec, list(overrides), first.spec.clusters, environ, python, force=force, done=first)
    answers = ask_each(plans, None, environ)
    shares: list[Share] = spread(n_points, answers, max_parallel)
    lines = describe(answers, None, "")[:-1]
    if not shares:
        raise UserError("no cluster the sweep names would take its points; nothing was submitted:\n"
                        + "\n".join(lines[1:]), exit_code=2)
    lines += [f"{s.cluster}: points {', '.join(map(str, s.points))}, at most {s.max_parallel} at once" for s in shares]
    return [Group(s.cluster, s.points, s.max_parallel) for s in shares], lines


def submit_groups(plans: Sequence[LaunchPlan], run_dirs: Sequence[str], sweep_dir: Path, groups: Sequence[Group],
                  *, new: bool, environ: Mapping[str, str] | None) -> tuple[list[str], list[str]]:
    """Every group's array queued on its cluster; (the arrays' ids, each point's job id)."""
    openings = [lifecycle.plan_opening(p, new=new, resume=False, record=runs.load_record(p.run_name, environ))
                for p in plans]
    applied: list[Any] = []
    queued: list[tuple[Any, list[str]]] = []
    job_ids: list[str] = [""] * len(plans)
    try:
        sweep_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for o in openings:
            o.apply(environ)
            applied.append(o)
        for g in groups:
            target = transport.profile_target(load_profile(plans[g.points[0]].profile, environ))
            with transport.through(target, exactly=True):
                arrays, ids = _submit_group(plans, run_dirs, sweep_dir, g)
            queued.append((target, arrays))
            for i, j in zip(g.points, ids):
                job_ids[i] = j
    except BaseException:
        for target, arrays in queued:  # all or nothing
            with contextlib.suppress(SlurmUnavailable, UserError), transport.through(target, exactly=True):
                slurm.cancel(arrays)
        for o in reversed(applied):
            o.rollback()
        raise
    return [a for _, arrays in queued for a in arrays], job_ids


def _submit_group(plans: Sequence[LaunchPlan], run_dirs: Sequence[str], sweep_dir: Path, g: Group) -> tuple[list[str], list[str]]:
    if not slurm.ping():
        where = f" of cluster '{g.cluster}'" if g.cluster else ""
        raise SlurmUnavailable(f"the SLURM controller{where} does not answer (`scontrol ping`); nothing was submitted")
    folder = g.folder(sweep_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    ids: list[str] = []

    def submit(part: range, dependency: str | None) -> str:  # each chunk after the one before (launcher.submit.arrays)
        chunk = [g.points[i] for i in part]
        got = submit_array(plans[chunk[0]], [run_dirs[i] for i in chunk], str(folder), g.max_parallel, dependency)
        ids.extend(got)
        return got[0].split("_")[0]

    return submit_chained(len(g.points), max_array_size(), submit), ids
