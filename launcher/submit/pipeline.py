"""Pipelines: stages of job specs submitted at once, each starting after the stages it names.

A pipeline file::

    name: tiny-pipe
    stages:
      - name: train
        spec: tiny-cpu.yaml              # relative to the pipeline file
        overrides: [trainer.max_steps=60]
      - name: eval
        spec: tiny-cpu.yaml
        after: [train]                   # STAGE[:ok|:any]; :ok (the default) is sbatch afterok
        overrides: ["eval.checkpoint=${train.checkpoint}"]

Each stage is its own run, named ``<pipeline>.<stage>``. ``${STAGE.checkpoint}`` (and
``${STAGE.run_dir}``) in an override is the run directory of an earlier stage: an eval stage
given it takes that run's newest complete checkpoint when it starts (lmtrain.task.evaluate), i.e. the
reference is resolved at run time. Every stage is validated and planned before anything is
submitted; a stage that SLURM refuses cancels the stages submitted before it, so a pipeline is
submitted whole or not at all. ``status`` shows a waiting stage with its reason (``Dependency``:
waiting for the upstream; ``DependencyNeverSatisfied``: the upstream failed, and ``lmlaunch
cancel`` clears it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from launcher.spec.validation import format_validation_error
from launcher.spec.yamlio import load_yaml_file
from lmcore.errors import SpecError
from lmcore.job.strict_model import StrictModel
from lmcore.text_rules import RunName

REFERENCE = re.compile(r"\$\{(?P<stage>[A-Za-z0-9_-]{1,64})\.(?P<what>checkpoint|run_dir)\}")
AFTER = re.compile(r"(?P<stage>[A-Za-z0-9_-]{1,64})(?::(?P<kind>ok|any))?")


class Stage(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """The stage's name; its run is <pipeline>.<name>."""
    spec: str = Field(min_length=1, max_length=4096)
    """The job spec, relative to the pipeline file."""
    overrides: list[str] = Field(default_factory=list, max_length=256)
    """Dotted overrides as on the command line; ${STAGE.checkpoint} names an earlier stage's run."""
    after: list[str] = Field(default_factory=list, max_length=32)
    """Earlier stages this one starts after: STAGE (completed successfully) or STAGE:any; and
    ``singleton``: not while another job of its name runs."""

    @field_validator("after")
    @classmethod
    def _after_syntax(cls, v: list[str]) -> list[str]:
        for ref in v:
            if ref != "singleton" and not AFTER.fullmatch(ref):
                raise ValueError(f"{ref!r} is not STAGE, STAGE:ok, STAGE:any or singleton")
        return v


class PipelineFile(StrictModel):
    name: RunName
    """The pipeline's name: the prefix of its stages' run names."""
    stages: list[Stage] = Field(min_length=1, max_length=32)


@dataclass(frozen=True)
class StagePlan:
    name: str
    run: str  # <pipeline>.<stage>
    spec_path: str
    overrides: list[str]  # references resolved, name=<run> added
    after: list[str]  # RUN[:ok|:any] of earlier stages


def load(path: str | Path) -> PipelineFile:
    loaded = load_yaml_file(path, "pipeline file")
    try:
        return PipelineFile.model_validate(loaded.data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, loaded, PipelineFile), source=str(path)) from None


def stage_plans(pipe: PipelineFile, pipeline_path: str | Path, run_dir_of: Mapping[str, str] | None = None,
                runs_root: str | None = None) -> list[StagePlan]:
    """Pure: the stages in order with their run names, dependencies and resolved references.
    ``run_dir_of`` (stage -> its run directory) resolves ``${STAGE.checkpoint}``; without it
    the run directory is ``<runs_root>/<run>``."""
    base = Path(pipeline_path).parent
    seen: dict[str, str] = {}
    out = []
    problems = []
    for i, st in enumerate(pipe.stages):
        where = f"stages[{i}] ({st.name})"
        if st.name in seen:
            problems.append(f"{where}: a second stage named {st.name!r}")
        run = f"{pipe.name}.{st.name}"
        after = []
        for ref in st.after:
            if ref == "singleton":  # sbatch's: one job of this name at a time
                after.append(ref)
                continue
            m = AFTER.fullmatch(ref)
            assert m is not None  # the schema checked it
            if m["stage"] not in seen:
                problems.append(f"{where}: after {ref!r}: no earlier stage {m['stage']!r} "
                                f"(earlier: {', '.join(seen) or 'none'})")
                continue
            after.append(f"{seen[m['stage']]}:{m['kind'] or 'ok'}")

        def resolve(m: re.Match[str], where: str = where) -> str:
            if m["stage"] not in seen:
                problems.append(f"{where}: {m[0]} names no earlier stage (earlier: {', '.join(seen) or 'none'})")
                return m[0]
            if run_dir_of is not None and m["stage"] in run_dir_of:
                return run_dir_of[m["stage"]]
            return str(Path(runs_root or ".") / seen[m["stage"]])

        overrides = [REFERENCE.sub(resolve, o) for o in st.overrides]
        spec_path = str((base / st.spec).resolve()) if not Path(st.spec).is_absolute() else st.spec
        out.append(StagePlan(st.name, run, spec_path, [*overrides, f"name={run}"], after))
        seen[st.name] = run
    if problems:
        raise SpecError(problems, source=str(pipeline_path))
    return out
