"""Sweeps: one job spec, many points, one throttled SLURM job array.

A sweep file::

    name: lr-sweep
    max_parallel: 2                 # the array's %N throttle (--max-parallel overrides it)
    grid:                           # every combination
      optim.lr: [0.001, 0.003]
      model.config.n_layer: [1, 2]
    zip:                            # lists of one length, taken together
      optim.warmup_steps: [1, 2]
      optim.min_lr: [0.0001, 0.0002]
    random:                         # seeded samples
      n: 3
      seed: 0
      params:
        optim.weight_decay: {uniform: [0.0, 0.1]}
        optim.lr: {log_uniform: [0.0001, 0.01]}
        data.micro_batch_size: {choice: [2, 4]}

The points are the product of the grid, the zip rows and the random samples (each part that is
given). Every point is its own run, ``<sweep>.<i>``, with its own run directory, ledger,
checkpoints and logs, planned and validated before anything is submitted: one invalid point
fails the whole sweep, naming it. All points are one SLURM array (split in chunks of
MaxArraySize, each starting after the one before, so the throttle holds over the whole sweep);
a point may change anything but the job's shape (its sbatch parameters and task environment).
Each array task finds its run directory in the script (``LMLAUNCH_RUN_DIR``) and imports that
run's code snapshot; preempting or requeueing a task touches that task only.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from typing import Any

from pydantic import Field, ValidationError, field_validator

from launcher.spec.validation import format_validation_error
from launcher.spec.yamlio import load_yaml_file
from launcher.submit.script import PER_POINT_ENV
from lmcore.errors import SpecError
from lmcore.job.plan import LaunchPlan
from lmcore.job.strict_model import StrictModel
from lmcore.search.search_spec import SearchFile
from lmcore.text_rules import RunName

KEY = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)+$"
MAX_POINTS = 10_000
# what an array task gets from the script instead of the plan (one value per point)


class Distribution(StrictModel):
    uniform: list[float] | None = Field(None, min_length=2, max_length=2)
    log_uniform: list[float] | None = Field(None, min_length=2, max_length=2)
    choice: list[Any] | None = Field(None, min_length=1, max_length=1000)

    @field_validator("log_uniform")
    @classmethod
    def _positive(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (v[0] <= 0 or v[1] <= 0):
            raise ValueError("log_uniform bounds must be > 0")
        return v

    def kind(self) -> str:
        given = [k for k in ("uniform", "log_uniform", "choice") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of uniform, log_uniform, choice (got {given or 'none'})")
        return given[0]


class RandomPart(StrictModel):
    n: int = Field(ge=1, le=MAX_POINTS)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    params: dict[str, Distribution] = Field(min_length=1, max_length=64)


class SweepFile(StrictModel):
    name: RunName
    """The sweep's name: its points are the runs <name>.<i>."""
    max_parallel: int | None = Field(None, ge=1, le=100_000)
    """At most this many points run at once (the array's %N throttle)."""
    grid: dict[str, list[Any]] = Field(default_factory=dict, max_length=64)
    zip: dict[str, list[Any]] = Field(default_factory=dict, max_length=64)
    random: RandomPart | None = None

    @field_validator("grid", "zip")
    @classmethod
    def _lists(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        import re

        for key, values in v.items():
            if not re.fullmatch(KEY, key):
                raise ValueError(f"{key!r} is not a dotted key of the job spec (e.g. optim.lr)")
            if not values:
                raise ValueError(f"{key}: an empty list sweeps nothing")
        return v


def load(path: str) -> SweepFile | SearchFile:
    """A sweep file: a grid/zip/random sweep, or (with a ``search`` key) a search
    (lmcore.search.search_spec)."""
    loaded = load_yaml_file(path, "sweep file")
    if isinstance(loaded.data, dict) and "search" in loaded.data:
        try:
            return SearchFile.model_validate(loaded.data)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc, loaded, SearchFile), source=path) from None
    try:
        sweep = SweepFile.model_validate(loaded.data)
        if sweep.random is not None:
            for dist in sweep.random.params.values():
                dist.kind()
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, loaded, SweepFile), source=path) from None
    except ValueError as exc:
        raise SpecError([f"random.params: {exc}"], source=path) from None
    if not (sweep.grid or sweep.zip or sweep.random):
        raise SpecError(["give grid, zip or random: there is nothing to sweep"], source=path)
    lengths = {k: len(v) for k, v in sweep.zip.items()}
    if len(set(lengths.values())) > 1:
        raise SpecError([f"zip: every list must have one length (got {lengths})"], source=path)
    return sweep


def points(sweep: SweepFile) -> list[dict[str, Any]]:
    """Pure: every point, in order (grid product, then zip rows, then random samples)."""
    parts: list[list[dict[str, Any]]] = []
    if sweep.grid:
        keys = list(sweep.grid)
        parts.append([dict(zip(keys, combo)) for combo in itertools.product(*(sweep.grid[k] for k in keys))])
    if sweep.zip:
        keys = list(sweep.zip)
        parts.append([dict(zip(keys, row)) for row in zip(*(sweep.zip[k] for k in keys))])
    if sweep.random is not None:
        rng = random.Random(sweep.random.seed)
        samples = []
        for _ in range(sweep.random.n):
            sample = {}
            for key, d in sweep.random.params.items():
                kind = d.kind()
                if kind == "uniform":
                    lo, hi = d.uniform  # type: ignore[misc]
                    sample[key] = rng.uniform(lo, hi)
                elif kind == "log_uniform":
                    lo, hi = d.log_uniform  # type: ignore[misc]
                    sample[key] = math.exp(rng.uniform(math.log(lo), math.log(hi)))
                else:
                    sample[key] = rng.choice(d.choice)  # type: ignore[arg-type]
            samples.append(sample)
        parts.append(samples)
    out = [dict(kv for part in combo for kv in part.items()) for combo in itertools.product(*parts)]
    if len(out) > MAX_POINTS:
        raise SpecError([f"{len(out)} points; a sweep has at most {MAX_POINTS}"])
    return out


def overrides(point: dict[str, Any]) -> list[str]:
    """A point as dotted overrides (values as YAML reads them back: JSON is YAML)."""
    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in point.items()]


def run_name(sweep: str, i: int) -> str:
    return f"{sweep}.{i}"


def shape(plan: LaunchPlan) -> dict[str, Any]:
    """What every point of one array must share: the sbatch parameters but the job name and the
    log paths, and the task environment but the per-point variables."""
    s = {k: v for k, v in plan.slurm.__dict__.items() if k not in ("job_name", "output", "error", "task_output",
                                                                     "task_error")}
    run_dir = plan.paths.run_dir  # a variable naming the run directory is set per point (launcher.search.array)
    env = {k: v.replace(run_dir, "<run dir>") for k, v in plan.env.items() if k not in PER_POINT_ENV}
    box = json.dumps(plan.container, sort_keys=True).replace(run_dir, "<run dir>")
    return {"slurm": s, "env": env, "setup": list(plan.setup), "python": plan.python,
            "srun_args": [a.replace(run_dir, "<run dir>") for a in plan.srun_args],
            "passthrough": list(plan.passthrough), "container": box}


def check_one_shape(plans: Sequence[LaunchPlan], pts: Sequence[dict[str, Any]], source: str) -> None:
    if plans[0].evaluator:  # SLURM: "job arrays of heterogeneous jobs are not supported"
        raise SpecError(["eval.alongside: a sweep is one SLURM job array, and an array cannot be of heterogeneous "
                         "jobs (trainer + evaluator); sweep without it and score the points after with "
                         "`lmlaunch eval RUN`, or submit each point on its own"], source=source)
    first = shape(plans[0])
    for i, plan in enumerate(plans[1:], 1):
        other = shape(plan)
        if other != first:
            diff = sorted(f"{part}.{k}" for part in first for k in set(first[part]) | set(other[part])
                          if isinstance(first[part], dict) and first[part].get(k) != other[part].get(k)) or \
                [p for p in first if first[p] != other[p]]
            raise SpecError([f"point {i} ({', '.join(overrides(pts[i]))}) changes the job's shape ({', '.join(diff)}) "
                             f"from point 0's: a sweep is one SLURM array of one shape; sweep that in its own sweep"],
                            source=source)
