"""The one owner of Optuna: a search's storage opened (its password read from its file, never
from a URL), its study, sampler, pruner and parameter distributions, and what a trial's rank 0
needs to report to it (:class:`TrialPlan`, carried in the trial run's plan). Optuna is imported
only here, and only when a search or a trial runs."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.errors import UserError
from lmcore.search.search_spec import Pruner, Sampler, SearchFile, Space
from lmcore.search.study_storage import StorageRef, mask_password

# the user attribute that ties a trial to its run
RUN_ATTR = "lmlaunch_run"
# a trial's user attributes that say why it failed or was pruned
WHY_ATTR = "lmlaunch_why"


@dataclass(frozen=True)
class TrialPlan:
    """What a trial run's rank 0 needs to report its metric to the study and learn it is pruned."""

    storage: StorageRef
    study: str
    number: int
    metric: str  # search_spec.METRICS
    direction: str
    pruner: dict[str, Any]  # search_spec.Pruner as JSON

    def to_json(self) -> dict[str, Any]:
        return {"storage": self.storage.to_json(), "study": self.study, "number": self.number, "metric": self.metric,
                "direction": self.direction, "pruner": dict(self.pruner)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrialPlan:
        return cls(StorageRef.from_json(d["storage"]), str(d["study"]), int(d["number"]), str(d["metric"]),
                   str(d["direction"]), dict(d["pruner"]))


def _quiet() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)


def read_password(path: str) -> str:
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"sweep_storage.password_file {p}: cannot read it ({exc.strerror})") from None
    line = text.splitlines()[0].strip() if text.strip() else ""
    if not line:
        raise UserError(f"sweep_storage.password_file {p} is empty: its first line is the database password")
    return line


def open_storage(ref: StorageRef) -> Any:
    """Optuna's storage for ``ref``: an RDB storage (the password added from its file here, in
    memory only) or a journal file."""
    import optuna

    _quiet()
    if ref.kind == "journal":
        from optuna.storages.journal import JournalFileBackend

        Path(ref.target).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(ref.target))
    from sqlalchemy.engine import make_url

    url = make_url(ref.target)
    if ref.password_file:
        url = url.set(password=read_password(ref.password_file))
    try:
        # pool_pre_ping: a connection the server closed while a trial trained is replaced, not an error
        return optuna.storages.RDBStorage(url.render_as_string(hide_password=False),
                                          engine_kwargs={"pool_pre_ping": True, "pool_recycle": 300})
    except Exception as exc:  # sqlalchemy's errors name the URL: say it without the password
        msg = str(exc).replace(url.password or "\0", "***") if url.password else str(exc)
        raise UserError(f"the sweep storage {mask_password(ref.target)} did not open: {msg.splitlines()[0][:300]}") \
            from None


def sampler(spec: Sampler, params: dict[str, Space], *, asked: int = 0) -> Any:
    """The search's sampler; ``asked``: trials the study holds already. A driver resumed after
    ``asked`` trials seeds its sampler past them (seed + asked): seeded afresh as at the start, it
    would ask the same values again (a random start repeats its first draws)."""
    import optuna

    if spec.seed is not None and asked:
        spec = spec.model_copy(update={"seed": (spec.seed + asked) % 2**32})

    if spec.name == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    if spec.name == "grid":
        grid = {key: space.values() for key, space in params.items()}
        return optuna.samplers.GridSampler(grid, seed=spec.seed)  # type: ignore[arg-type]
    if spec.name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=spec.seed, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=spec.seed)


def pruner(spec: Pruner | dict[str, Any]) -> Any:
    import optuna

    p = spec if isinstance(spec, Pruner) else Pruner.model_validate(spec)
    if p.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps,
                                           interval_steps=p.interval_steps)
    if p.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_resource or 1,
                                                      reduction_factor=p.reduction_factor)
    if p.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_resource or 1, reduction_factor=p.reduction_factor)
    return optuna.pruners.NopPruner()


def distribution(space: Space) -> Any:
    from optuna import distributions as d

    if space.categorical is not None:
        return d.CategoricalDistribution(space.categorical)
    if space.int_range is not None:
        low, high = space.int_range
        return d.IntDistribution(low, high, log=space.log, step=int(space.step or 1))
    lo, hi = space.float_range or (0.0, 1.0)
    return d.FloatDistribution(lo, hi, log=space.log, step=space.step)


def create_study(search: SearchFile, ref: StorageRef) -> Any:
    """The search's study, made now; an existing study of that name is an error (resume it)."""
    import optuna

    storage = open_storage(ref)
    try:
        return optuna.create_study(study_name=search.name, storage=storage, direction=search.objective.direction,
                                   sampler=sampler(search.sampler, search.params), pruner=pruner(search.pruner),
                                   load_if_exists=False)
    except optuna.exceptions.DuplicatedStudyError:
        raise UserError(f"a study named '{search.name}' already exists in {ref.describe()}: "
                        f"`lmlaunch sweep resume {search.name}` continues that search; give a new one another name") \
            from None


def load_study(search: SearchFile, ref: StorageRef) -> Any:
    import optuna

    storage = open_storage(ref)
    try:
        st = optuna.load_study(study_name=search.name, storage=storage, pruner=pruner(search.pruner))
    except KeyError:
        raise UserError(f"no study named '{search.name}' in {ref.describe()}") from None
    st.sampler = sampler(search.sampler, search.params, asked=len(st.get_trials(deepcopy=False)))
    return st


def finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def tell(st: Any, number: int, value: float | None = None, *, state: Any = None) -> None:
    """``study.tell`` from the driver (outside Optuna's own optimize loop). The grid sampler asks
    the study to stop once its last point is told, which raises outside optimize; the trial's
    state is stored before that (Optuna stores it in a ``finally``), so it is not an error here."""
    try:
        if state is None:
            st.tell(number, value)
        else:
            st.tell(number, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def trial_id(st: Any, number: int) -> int:
    """The storage's id of trial ``number`` of study ``st`` (Optuna's tell and ask take numbers;
    user attributes and a trial's record need the id)."""
    return int(st._storage.get_trial_id_from_study_id_trial_number(st._study_id, number))

