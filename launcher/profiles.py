"""Cluster profiles: what a cluster offers and how jobs must run on it.

A profile is a YAML file in ``cluster_profiles/`` (or a directory named by
``LMLAUNCH_PROFILES_DIR``). Profiles are written by whoever knows the cluster; job specs
pick one by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from launcher.errors import SpecError, did_you_mean
from launcher.spec import ENV_NAME_RE, MEM_RE, parse_slurm_time
from launcher.validation import format_validation_error
from launcher.yamlio import load_yaml_file

REPO_PROFILES = Path(__file__).resolve().parent.parent / "cluster_profiles"


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True
    )


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
# SLURM reads --output/--error paths itself: '%' starts a filename pattern, '\\' escapes even
# inside quotes, and a #SBATCH line cannot hold a line break.
_SLURM_PATH_BAD = re.compile(r"[%\\\x00-\x1f\x7f]")


def expand_path(raw: str, environ: Mapping[str, str], what: str) -> str:
    """Expand ``~`` and ``$VAR``/``${VAR}`` from ``environ``; an unset variable is an error.

    ``what`` names where the path came from (for the message).
    """
    text = raw
    if text == "~" or text.startswith("~/"):
        home = environ.get("HOME")
        if not home:
            raise SpecError([f"{what} '{raw}' starts with ~ but HOME is not set in this shell"])
        text = home + text[1:]
    missing = [a or b for a, b in _VAR.findall(text) if not environ.get(a or b)]
    if missing:
        raise SpecError(
            [
                f"{what} '{raw}' uses ${missing[0]}, which is not set (or empty) in this shell; "
                f"set {missing[0]}, or set LMLAUNCH_RUNS_ROOT to the runs root to use"
            ]
        )
    return _VAR.sub(lambda m: environ[m.group(1) or m.group(2)], text)


def check_slurm_path(path: str, what: str) -> None:
    """Reject a path that SLURM cannot take in #SBATCH --output (clear message, no broken script)."""
    bad = _SLURM_PATH_BAD.search(path)
    if bad:
        raise SpecError(
            [
                f"{what} {path!r} contains {bad.group()!r}, which SLURM cannot take in a "
                "#SBATCH --output path (no '%', backslash, line breaks or control characters); "
                "choose another directory"
            ]
        )


class Partition(_Strict):
    """A SLURM partition of the cluster."""

    max_time: str
    """Longest wall-clock limit the partition accepts (SLURM time)."""
    preemptible: bool = False
    """Jobs here can be preempted (requeued) by higher-priority partitions."""
    grace_seconds: int | None = Field(None, ge=0)
    """GraceTime between SIGTERM and SIGKILL on preemption, when known."""

    @field_validator("max_time")
    @classmethod
    def _t(cls, v: str) -> str:
        parse_slurm_time(v)
        return v

    @property
    def max_minutes(self) -> int:
        return parse_slurm_time(self.max_time)


class EnvVar(_Strict):
    """A fabric variable with its reason."""

    value: str
    """Value exported in every task."""
    why: str
    """One line: why this cluster needs it."""

    @field_validator("value", mode="before")
    @classmethod
    def _number_as_text(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)
        return v

    @field_validator("why")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if not v.strip() or "\n" in v.strip():
            raise ValueError("why must be one non-empty line")
        return v.strip()


class Container(_Strict):
    """A container the tasks run in (pyxis/enroot)."""

    image: str
    """Container image (pyxis/enroot --container-image)."""
    mounts: list[str] = Field(default_factory=list)
    """Bind mounts src:dst."""


class Profile(_Strict):
    """A cluster: partitions, hardware per node, filesystem, setup and fabric environment."""

    name: str
    """Profile name (the file's stem)."""
    description: str = ""
    """What cluster this is."""
    partitions: dict[str, Partition]
    """Partitions jobs may use, by name."""
    default_partition: str
    """Partition used when the job names none."""
    preemptible_partition: str | None = None
    """Low-priority partition where jobs may be preempted."""
    high_priority_partition: str | None = None
    """High-priority partition (preempts the preemptible one)."""
    account: str | None = None
    """Default SLURM account."""
    qos: str | None = None
    """Default QOS."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs in each node (0: a CPU-only cluster)."""
    gres_name: str = "gpu"
    """GRES name for GPUs (gpu, or typed like gpu:h100)."""
    cpus_per_gpu: int = Field(1, ge=1)
    """CPU cores per GPU task (or per CPU task on a CPU-only cluster)."""
    mem_per_gpu: str | None = None
    """Memory per GPU (e.g. 200G); the job's mem per node defaults to this x GPUs."""
    max_tasks_per_node: int = Field(64, ge=1)
    """Most tasks a node runs (CPU-only clusters: cores per node)."""
    exclusive: bool = False
    """Request whole nodes by default."""
    runs_root: str
    """Root of run directories on a filesystem every node sees (~ and $VARS expanded)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run in the batch script before the tasks start (module load, venv)."""
    python: str = "python"
    """Python interpreter on the nodes (after setup). 'auto': the interpreter running lmlaunch (clusters that share its venv, such as local)."""
    container: Container | None = None
    """Run tasks in this container (pyxis)."""
    sends_user_signal_on_preemption: bool = False
    """The cluster sets SlurmctldParameters=preempt_send_user_signal."""
    env: dict[str, EnvVar] = Field(default_factory=dict)
    """NCCL / fabric environment, each with its reason."""

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvVar]) -> dict[str, EnvVar]:
        for name in v:
            if not ENV_NAME_RE.match(name):
                raise ValueError(f"'{name}' is not a valid environment variable name")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not v.strip() or any(c in v for c in "\n\r\x00"):
            raise ValueError("python must be 'auto' or an interpreter command on one line")
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for i, line in enumerate(v):
            if "\n" in line or "\r" in line:
                raise ValueError(f"setup[{i}] holds a line break; write one shell line per list item")
        return v

    @field_validator("runs_root")
    @classmethod
    def _runs_root(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("runs_root must be a directory path")
        return v

    @field_validator("mem_per_gpu")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None and not MEM_RE.match(v):
            raise ValueError(f"'{v}' is not a SLURM memory size; use e.g. 200G")
        return v

    @model_validator(mode="after")
    def _parts(self) -> Profile:
        names = list(self.partitions)
        for field in ("default_partition", "preemptible_partition", "high_priority_partition"):
            value = getattr(self, field)
            if value is not None and value not in self.partitions:
                raise ValueError(
                    f"{field} '{value}' is not among partitions ({', '.join(names)})"
                    f"{did_you_mean(value, names)}"
                )
        if not re.match(r"^[A-Za-z0-9_:.-]+$", self.gres_name):
            raise ValueError(f"gres_name '{self.gres_name}' is not a GRES name")
        return self

    @property
    def runs_root_path(self) -> Path:
        """runs_root expanded from this process's environment (unset variables are an error)."""
        return Path(expand_path(self.runs_root, os.environ, f"profile '{self.name}' runs_root"))

    def python_command(self, interpreter: str) -> str:
        """The interpreter command tasks run: ``python`` as written, or ``interpreter`` for auto."""
        return interpreter if self.python == "auto" else self.python


def profile_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    env = os.environ if environ is None else environ
    dirs = []
    extra = env.get("LMLAUNCH_PROFILES_DIR")
    if extra:
        dirs.extend(Path(p) for p in extra.split(os.pathsep) if p)
    dirs.append(REPO_PROFILES)
    return dirs


def available_profiles(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Profile name -> file; earlier directories win."""
    found: dict[str, Path] = {}
    for d in profile_dirs(environ):
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                found.setdefault(f.stem, f)
    return found


def load_profile_file(path: str | Path) -> Profile:
    loaded = load_yaml_file(path)
    data = loaded.data
    if not isinstance(data, dict):
        raise SpecError(["a cluster profile must be a YAML mapping"], source=str(path))
    if "name" in data and data["name"] != Path(path).stem:
        raise SpecError(
            [f"name '{data['name']}' differs from the file name; a profile is named by its file ({Path(path).stem})"],
            source=str(path),
        )
    data = {"name": Path(path).stem, **data}
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, loaded, Profile), source=str(path)) from None


def load_profile(name: str, environ: Mapping[str, str] | None = None) -> Profile:
    profiles = available_profiles(environ)
    if name not in profiles:
        raise SpecError(
            [
                f"cluster: unknown profile '{name}'{did_you_mean(name, profiles)}; "
                f"available: {', '.join(sorted(profiles)) or 'none'}"
            ]
        )
    return load_profile_file(profiles[name])


def profile_summary(p: Profile) -> dict[str, Any]:
    return {
        "name": p.name,
        "description": p.description,
        "gpus_per_node": p.gpus_per_node,
        "partitions": {k: v.max_time for k, v in p.partitions.items()},
        "default_partition": p.default_partition,
        "runs_root": p.runs_root,
        "python": p.python,
        "env": sorted(p.env),
    }


__all__ = ["Profile", "Partition", "EnvVar", "load_profile", "available_profiles", "Literal"]
