"""A search sweep file (``search: optuna``): the parameter spaces, the sampler, the pruner and the
objective. Pure: schema and checks; :mod:`lmcore.search.study` turns them into Optuna's objects.

::

    name: lr-search
    search: optuna
    trials: 8                        # how many trials in all
    max_parallel: 2                  # at most this many queued or running at once
    objective: {metric: val_loss, at: last, direction: minimize}
    sampler: {name: tpe, seed: 0}    # tpe | random | grid | cmaes
    pruner: {name: median, startup_trials: 2, warmup_steps: 10}   # median | asha | hyperband | none
    params:
      optim.lr: {float: [1.0e-4, 1.0e-2], log: true}
      optim.warmup_steps: {int: [0, 20]}
      data.micro_batch_size: {categorical: [2, 4]}
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmcore.job.strict_model import StrictModel
from lmcore.text_rules import RunName

KEY = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)+$"
MAX_TRIALS = 10_000
# what a run logs that a search may optimise: the heartbeat's step `loss` (every log_every_n_steps)
# and its `val` events' `val_loss` (every val_check_interval)
METRICS = ("val_loss", "loss")
SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("median", "asha", "hyperband", "none")


class Space(StrictModel):
    """One parameter's space: exactly one of float, int, categorical."""

    float_range: list[float] | None = Field(None, min_length=2, max_length=2, alias="float")
    """[low, high]: a real number in the range (both ends included)."""
    int_range: list[int] | None = Field(None, min_length=2, max_length=2, alias="int")
    """[low, high]: an integer in the range (both ends included)."""
    categorical: list[Any] | None = Field(None, min_length=1, max_length=1000)
    """The values to choose among (numbers, strings, booleans)."""
    log: bool = False
    """Sample on a log scale (float and int ranges whose low end is above 0)."""
    step: float | None = Field(None, gt=0)
    """A grid within the range (low, low+step, ...); not with log."""

    @model_validator(mode="after")
    def _one(self) -> Space:
        given = [k for k, v in (("float", self.float_range), ("int", self.int_range), ("categorical", self.categorical))
                 if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of float, int, categorical (got {', '.join(given) or 'none'})")
        rng = self.float_range if self.float_range is not None else self.int_range
        if rng is None:
            if self.log or self.step is not None:
                raise ValueError("log and step go with a float or int range, not with categorical")
            if len({repr(v) for v in self.categorical or []}) != len(self.categorical or []):
                raise ValueError(f"categorical {self.categorical}: a value is given twice")
            return self
        low, high = rng
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"[{low}, {high}]: the ends must be finite numbers")
        if low > high:
            raise ValueError(f"[{low}, {high}] is inverted: give [low, high] with low < high")
        if low == high:
            raise ValueError(f"[{low}, {high}] is empty: a range needs low < high (a fixed value is an override)")
        if self.log and low <= 0:
            raise ValueError(f"[{low}, {high}] with log: true touches 0 or below: a log range needs low > 0")
        if self.log and self.step is not None:
            raise ValueError("step and log: true do not go together")
        if self.int_range is not None and self.step is not None and self.step != round(self.step):
            raise ValueError(f"step {self.step}: an int range takes a whole step")
        return self

    def kind(self) -> str:
        return "float" if self.float_range is not None else "int" if self.int_range is not None else "categorical"

    def values(self) -> list[Any] | None:
        """Every value, where the space is finite (categorical, int, or float with a step); else None."""
        if self.categorical is not None:
            return list(self.categorical)
        if self.int_range is not None:
            step = int(self.step or 1)
            return list(range(self.int_range[0], self.int_range[1] + 1, step)) if not self.log else None
        if self.float_range is not None and self.step is not None:
            n = int(math.floor((self.float_range[1] - self.float_range[0]) / self.step + 1e-9)) + 1
            return [self.float_range[0] + i * self.step for i in range(n)]
        return None

    def corners(self) -> list[Any]:
        """The values the planner tries before anything is submitted: the ends, or every choice."""
        if self.categorical is not None:
            return list(self.categorical)
        rng = self.float_range if self.float_range is not None else self.int_range
        return list(rng or [])


class Objective(StrictModel):
    """What the search optimises: a metric the runs log."""

    metric: Literal["val_loss", "loss"] = "val_loss"
    """val_loss (each validation: needs a validation split and trainer.val_check_interval) or loss (the training loss, every trainer.log_every_n_steps)."""
    at: Literal["last", "best"] = "last"
    """The trial's value: the metric's last logged value, or its best."""
    direction: Literal["minimize", "maximize"] = "minimize"
    """minimize (a loss) or maximize."""


class Sampler(StrictModel):
    """How the next trial's parameters are chosen."""

    name: Literal["tpe", "random", "grid", "cmaes"] = "tpe"
    """tpe (Optuna's default, Bayesian), random, grid (every combination of finite spaces, in Optuna's order), cmaes (CMA-ES over numeric spaces)."""
    seed: int | None = Field(0, ge=0, le=2**32 - 1)
    """The sampler's seed (null: a fresh one)."""


class Pruner(StrictModel):
    """Which running trials stop early: at each reported step, against the others' values there."""

    name: Literal["median", "asha", "hyperband", "none"] = "median"
    """median (stop a trial whose value is worse than the median of the others at the same step), asha (asynchronous successive halving), hyperband, none."""
    startup_trials: int = Field(2, ge=0, le=10_000)
    """median: no trial is pruned before this many trials completed."""
    warmup_steps: int = Field(0, ge=0)
    """median: no trial is pruned before this step."""
    interval_steps: int = Field(1, ge=1)
    """median: check at every n-th reported step."""
    min_resource: int | None = Field(None, ge=1)
    """asha, hyperband: the least steps a trial runs before it can be stopped (default: Optuna's estimate for hyperband, 1 for asha)."""
    reduction_factor: int = Field(3, ge=2, le=100)
    """asha, hyperband: the fraction 1/n of trials that go on at each rung."""


class SearchFile(StrictModel):
    """A search sweep: Optuna trials, each a run of its own, at most max_parallel at once."""

    name: RunName
    """The search's name: its trials are the runs <name>.<trial number> (from 0)."""
    search: Literal["optuna"]
    """optuna: trials asked from an Optuna study as slots free up (a grid/zip/random sweep file has no search key)."""
    trials: int = Field(ge=1, le=MAX_TRIALS)
    """How many trials in all (completed, pruned and failed ones count)."""
    max_parallel: int = Field(1, ge=1, le=10_000)
    """At most this many trials queued or running at once."""
    objective: Objective = Field(default_factory=Objective)
    sampler: Sampler = Field(default_factory=Sampler)
    pruner: Pruner = Field(default_factory=Pruner)
    params: dict[str, Space] = Field(min_length=1, max_length=64)
    """The spaces, by dotted job spec key (e.g. optim.lr)."""

    @field_validator("params")
    @classmethod
    def _keys(cls, v: dict[str, Space]) -> dict[str, Space]:
        for key in v:
            if not re.fullmatch(KEY, key):
                raise ValueError(f"{key!r} is not a dotted key of the job spec (e.g. optim.lr)")
            if key == "name" or key.startswith(("resources.", "slurm.", "container.")):
                raise ValueError(f"{key}: a search varies the training, not the job's name or shape")
        return v

    @model_validator(mode="after")
    def _sampler_fits(self) -> SearchFile:
        if self.sampler.name == "grid":
            sizes = {}
            for key, space in self.params.items():
                values = space.values()
                if values is None:
                    raise ValueError(f"sampler grid: params.{key} is a continuous range; give it categorical "
                                     f"values or a step")
                sizes[key] = len(values)
            total = math.prod(sizes.values())
            if self.trials > total:
                raise ValueError(f"sampler grid: trials({self.trials}) > the grid's {total} points "
                                 f"({' x '.join(f'{k}({n})' for k, n in sizes.items())})")
        if self.sampler.name == "cmaes" and all(s.kind() == "categorical" for s in self.params.values()):
            raise ValueError("sampler cmaes searches numeric ranges; every param here is categorical (use tpe)")
        return self

    def run_name(self, number: int) -> str:
        return f"{self.name}.{number}"
