"""The model section checked against the installed transformers before anything is planned or
submitted: whatever validates builds. transformers holds what only it knows (an architecture's
default special token ids, which attention kernels its model class supports, what sizes its
layers take), so the check is lmtrain.model.causal_lm.check_model_spec, the runtime's own, run in this
process: importing the training stack costs about 3 s the first time a model section is seen;
the answer is kept per model section and transformers version (in memory, and in the user's
cache directory, so that the next validate, dry run or submit of it is instant). Without the
training stack (a CLI-only install) the check is said to be left to ``doctor`` where the jobs
run. A spec with ``model.pretrained`` is checked when the job loads it (its directory may only
be visible to the nodes)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pwd
import warnings
from collections.abc import Mapping
from pathlib import Path

from launcher.planning import runtime_stack
from lmcore.atomic import write_private
from lmcore.errors import SpecError
from lmcore.job import pipeline_stages
from lmcore.job.parallelism import Parallelism
from lmcore.job.plan import Topology
from lmcore.job.spec import ModelSpec, TensorSplit

CHECK_VERSION = 7  # bump when check_model_spec checks more: older answers are not reused
_seen: dict[str, tuple[str, str]] = {}  # key -> (the problem or "", a note or "")


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_CACHE_HOME/lmlaunch/model-checks, else ~/.cache/... of the user running lmlaunch (from
    the password database: the same for every LMLAUNCH_HOME and HOME this user sets)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache")
    return Path(base) / "lmlaunch" / "model-checks"


def split_of(topology: Topology) -> TensorSplit | None:
    """How the plan splits each model replica (tensor parallelism), for the check; None: not split."""
    par = topology.parallelism
    if par.tensor == 1:
        return None
    return TensorSplit(par.tensor, par.sequence_parallel)


def check_model(model: ModelSpec, environ: Mapping[str, str] | None = None, *,
                split: TensorSplit | None = None, pipeline: int = 1, schedule: str = "1f1b") -> str | None:
    """SpecError naming the setting when transformers cannot build the model section as written
    (or the architecture cannot be split as ``split`` says: its TP plan, its heads; or into
    ``pipeline`` stages under ``schedule``: one list of blocks, a final norm, each stage's forward
    run: lmtrain.model.pipeline_check); a note when it (or its stages) cannot be checked here; None
    when it builds."""
    if model.type is None:
        return None
    lacking = runtime_stack.missing()
    if lacking is not None:
        return (f"model section not checked against transformers here ({lacking} is not "
                f"installed: {runtime_stack.INSTALL}); `lmlaunch doctor` checks it where the jobs run")
    key = _key(model, split, pipeline, schedule)
    answer = _seen.get(key) or _cached(key, environ)
    if answer is None:
        answer = _check(model, split, pipeline, schedule)
        _remember(key, answer, environ)
    _seen[key] = answer
    problem, note = answer
    if problem:
        raise SpecError([problem])
    return note or None


def _key(model: ModelSpec, split: TensorSplit | None, pipeline: int = 1, schedule: str = "1f1b") -> str:
    what = {"check": CHECK_VERSION, "transformers": importlib.metadata.version("transformers"),
            "torch": importlib.metadata.version("torch"), "model": model.model_dump(mode="json"),
            **({"split": list(split)} if split else {}),
            **({"pipeline": pipeline, "schedule": schedule} if pipeline > 1 else {})}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _check(model: ModelSpec, split: TensorSplit | None, pipeline: int = 1, schedule: str = "1f1b") -> tuple[str, str]:
    """(the problem or "", a note or ""). transformers' own warnings about the config stay out of
    the CLI's output: the problem, if any, is said once, naming the setting."""
    from transformers.utils import logging as hf_logging  # torch and transformers: the first time only

    from lmtrain.model.causal_lm import check_model_spec

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    note = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_model_spec(model)
            if split is not None:
                from lmtrain.model.tensor_parallel import check_split

                note = check_split(model, split) or None
            if pipeline > 1:
                from lmtrain.model.pipeline_check import check_pipeline

                note = "; ".join(n for n in (note, check_pipeline(model, pipeline, schedule)) if n)
    except ValueError as exc:
        return str(exc), ""
    finally:
        hf_logging.set_verbosity(level)
    return "", note or ""


def _cached(key: str, environ: Mapping[str, str] | None) -> tuple[str, str] | None:
    try:
        data = json.loads((cache_dir(environ) / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    problem = data.get("problem") if isinstance(data, dict) else None
    note = data.get("note", "") if isinstance(data, dict) else None
    return (problem, note) if isinstance(problem, str) and isinstance(note, str) else None


def _remember(key: str, answer: tuple[str, str], environ: Mapping[str, str] | None) -> None:
    try:
        where = cache_dir(environ)
        where.mkdir(parents=True, exist_ok=True)
        write_private(where / f"{key}.json", json.dumps({"problem": answer[0], "note": answer[1]}) + "\n")
    except OSError:
        pass  # a cache only: the next command checks again


def pretrained_pipeline_problems(model: ModelSpec, parallelism: Parallelism) -> list[str]:
    """What a pipeline needs of a pretrained model (its directory's config.json, the spec's
    ``model.config`` over it), checked before anything is submitted; [] when there is no
    pipeline, no pretrained directory here, or nothing wrong."""
    if parallelism.pipeline == 1 or not model.pretrained:
        return []
    path = Path(model.pretrained) / "config.json"
    try:
        config = {**json.loads(path.read_text()), **dict(model.config)}
    except (OSError, ValueError):
        return []  # not readable here: the runtime checks the model it builds
    return pipeline_stages.model_problems(parallelism.pipeline, parallelism.schedule,
                                          list(parallelism.split) if parallelism.split else None,
                                          config.get("model_type"), config, pretrained=str(path))
