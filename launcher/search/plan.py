"""A search's plan and its directory (pure but for reading files and planning trials): the search's
``search.json`` (:class:`SearchState`: what ``sweep resume`` needs), the registry's pointer to the
directory, each trial's plan (the spec, the search's overrides, the trial's values and the trial
its rank 0 reports to), the checks made before anything is created, and the dry run.
:mod:`launcher.search.driver` runs the search."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from launcher.context import Context
from launcher.planning.clusters import plan_each
from launcher.planning.resolve import Resolved, resolve
from launcher.search import sweep
from launcher.submit.start_estimates import place
from lmcore.errors import SpecError, UserError
from lmcore.run import rundir
from lmcore.search import study
from lmcore.search.search_spec import SearchFile
from lmcore.search.study_storage import StorageRef

STATE = "search.json"
LOG = "driver.log"
LOCK = "driver.lock"


@dataclasses.dataclass(frozen=True)
class SearchState:
    """What resume needs: written once when the search starts."""

    name: str
    spec: str
    file: str
    overrides: list[str]
    cluster: str | None
    storage: dict[str, Any]
    search: dict[str, Any]  # the search file as validated (by alias: as a user writes it)

    def search_file(self) -> SearchFile:
        return SearchFile.model_validate(self.search)

    def ref(self) -> StorageRef:
        return StorageRef.from_json(self.storage)

    @classmethod
    def read(cls, directory: Path) -> SearchState:
        return cls(**json.loads((directory / STATE).read_text()))


def trial_resolved(state: SearchState, number: int, params: dict[str, Any], ctx: Context) -> Resolved:
    """The plan of trial ``number``: the spec with the search's overrides and the trial's values,
    and the trial its rank 0 reports to."""
    search = state.search_file()
    ov = [*state.overrides, *sweep.overrides(params), f"name={search.run_name(number)}"]
    r = resolve(state.spec, ov, state.cluster, ctx.environ, python=ctx.python, several=True)
    if spread_over(r, state.cluster):  # several: where this trial starts soonest
        chosen, _, lines = place(state.spec, ov, r, ctx.environ, ctx.python)
        if chosen is None:
            raise UserError("no cluster the search names would take the trial:\n" + "\n".join(lines[1:-1]))
        r = chosen
    trial = study.TrialPlan(state.ref(), search.name, number, search.objective.metric, search.objective.direction,
                            search.pruner.model_dump())
    return dataclasses.replace(r, plan=dataclasses.replace(r.plan, trial=trial.to_json()))


def check_corners(spec: str, overrides: list[str], cluster: str | None, search: SearchFile, ctx: Context,
                  source: str) -> Resolved:
    """Every parameter's ends (or every choice), the others at their low ends, planned as a trial
    would be: a key not in the spec, a value the spec refuses, a metric the runs never log: an
    error naming it, before anything is made."""
    low = {k: s.corners()[0] for k, s in search.params.items()}
    first: Resolved | None = None
    for key, space in search.params.items():
        for value in space.corners():
            point = {**low, key: value}
            ov = [*overrides, *sweep.overrides(point), f"name={search.run_name(0)}"]
            try:
                r = resolve(spec, ov, cluster, ctx.environ, python=ctx.python, several=True)
                if spread_over(r, cluster):  # its trials may go to each: each must run it
                    plan_each(spec, ov, r.spec.clusters or [], ctx.environ, ctx.python, done=r)
            except SpecError as exc:
                raise SpecError([f"search {source}, params.{key} = {value!r}: {p}" for p in exc.problems],
                                source=exc.source, exit_code=exc.exit_code) from None
            first = first or r
    assert first is not None
    _one_study(first, ctx, source)
    plan = first.plan
    if search.objective.metric == "val_loss" and plan.trainer.val_check_interval is None:
        raise SpecError([f"objective.metric val_loss: the runs never log it (validation is off: "
                         f"trainer.limit_val_batches {plan.trainer.limit_val_batches}); validate "
                         f"(trainer.val_check_interval, limit_val_batches > 0) or optimise loss"], source=source)
    if search.pruner.name != "none" and search.objective.metric == "val_loss":
        every = plan.trainer.val_every_n_steps or plan.trainer.max_steps
        if every >= plan.trainer.max_steps:
            raise SpecError([f"pruner {search.pruner.name}: val_loss is logged once, at the end "
                             f"(val every {every} of {plan.trainer.max_steps} steps): nothing to prune on; "
                             f"validate more often or use pruner: {{name: none}}"], source=source)
    return first


def _one_study(first: Resolved, ctx: Context, source: str) -> None:
    """A search over several clusters keeps one study, in the first cluster's sweep_storage: a
    cluster whose profile names another one is refused (its trials would report elsewhere)."""
    from launcher.spec.profiles import load_profile

    for name in first.spec.clusters or []:
        profile = load_profile(name, ctx.environ)
        if profile.login is not None:
            raise SpecError([f"clusters: {name} is reached over SSH: the lmlaunch there plans a trial's run again, "
                             "without the trial its ranks report to (no pruning, no objective in the study); a "
                             "search names clusters reached from here"], source=source)
        other = profile.sweep_storage
        if other is not None and other != first.profile.sweep_storage:
            said = other.model_dump(exclude_none=True, exclude_defaults=True)
            raise SpecError([f"clusters: {name}'s profile keeps its searches elsewhere ({said}) "
                             f"than {first.profile.name}'s: the trials of one search report to one study (the first "
                             "cluster's sweep_storage), which every cluster's ranks must reach; give them one"],
                            source=source)


# --------------------------------------------------------------------------- the directory
def pointer_file(name: str, ctx: Context) -> Path:
    """Where the registry keeps a search's directory (in $LMLAUNCH_HOME, beside the runs' records)."""
    from launcher.runs.home import lmlaunch_home

    return lmlaunch_home(ctx.environ or None) / "searches" / name


def find(name: str, ctx: Context) -> Path:
    """A search's directory, as its start recorded it."""
    pointer = pointer_file(name, ctx)
    try:
        directory = Path(pointer.read_text().strip())
    except OSError:
        raise UserError(f"no search named {name!r} in the registry ({pointer.parent})") from None
    if not (directory / STATE).exists():
        raise UserError(f"search {name!r}: its directory {directory} holds no {STATE} (moved or removed?)")
    return directory


def mark_cancelled(name: str, ctx: Context) -> Path | None:
    """`lmlaunch cancel SEARCH`: the search's directory marked CANCELLED (before its trials' jobs
    are cancelled), so that its driver asks no more trials and stops; None: no such search."""
    try:
        directory = find(name, ctx)
    except UserError:
        return None
    marker = rundir.RunLayout.of(directory).cancelled
    marker.write_text(f"cancelled at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    return marker


# --------------------------------------------------------------------------- the dry run
def spread_over(first: Resolved, cluster: str | None) -> list[str]:
    """The clusters a search's trials are placed on, each where it starts soonest ([]: the one it plans on)."""
    return list(first.spec.clusters or []) if not cluster or "," in cluster else []


def render_dry_run(search: SearchFile, ref: StorageRef, directory: Path, first: Resolved, ctx: Context,
                   json_out: bool, clusters: list[str] | None = None) -> int:
    spaces = {k: s.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
              for k, s in search.params.items()}
    if json_out:
        ctx.out(json.dumps({"search": search.name, "trials": search.trials, "max_parallel": search.max_parallel,
                            "sampler": search.sampler.model_dump(), "pruner": search.pruner.model_dump(),
                            "objective": search.objective.model_dump(), "params": spaces,
                            "storage": ref.describe(), "directory": str(directory),
                            **({"clusters": clusters} if clusters else {})}, indent=2))
        return 0
    o = search.objective
    ctx.out(f"# search '{search.name}': {search.trials} trials, at most {search.max_parallel} queued or running at "
            f"once; nothing submitted")
    ctx.out(f"objective: {o.direction} {o.metric} ({o.at} logged value)")
    ctx.out(f"sampler:   {search.sampler.name} (seed {search.sampler.seed})")
    ctx.out(f"pruner:    {search.pruner.name}")
    for k, s in spaces.items():
        ctx.out(f"  {k}: {json.dumps(s)}")
    ctx.out(f"study:     {ref.describe()}")
    ctx.out(f"trials:    runs {search.run_name(0)} .. {search.run_name(search.trials - 1)}, each planned as "
            f"{first.plan.topology.nodes} node(s) x {first.plan.topology.tasks_per_node} task(s), "
            f"{first.plan.trainer.max_steps} steps")
    if clusters:
        ctx.out(f"clusters:  {', '.join(clusters)}: each trial goes where it starts soonest when it is submitted "
                f"(sbatch --test-only on each); at most {search.max_parallel} at once in all")
    return 0
