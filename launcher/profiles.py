"""Cluster profiles: what a cluster offers and how jobs must run on it.

A profile is a YAML file in ``cluster_profiles/`` (or a directory named by
``LMLAUNCH_PROFILES_DIR``). Profiles are written by whoever knows the cluster; job specs
pick one by name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from launcher.errors import SpecError, did_you_mean
from launcher.spec import ENV_NAME_RE, MEM_RE, parse_slurm_time
from launcher.validation import format_validation_error
from launcher.yamlio import load_yaml_file

REPO_PROFILES = Path(__file__).resolve().parent.parent / "cluster_profiles"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class Partition(_Strict):
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
    value: str
    """Value exported in every task."""
    why: str
    """One line: why this cluster needs it."""


class Container(_Strict):
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
    """Python interpreter on the nodes (after setup)."""
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
        return Path(os.path.expandvars(os.path.expanduser(self.runs_root)))


def profile_dirs() -> list[Path]:
    dirs = []
    extra = os.environ.get("LMLAUNCH_PROFILES_DIR")
    if extra:
        dirs.extend(Path(p) for p in extra.split(os.pathsep) if p)
    dirs.append(REPO_PROFILES)
    return dirs


def available_profiles() -> dict[str, Path]:
    """Profile name -> file; earlier directories win."""
    found: dict[str, Path] = {}
    for d in profile_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                found.setdefault(f.stem, f)
    return found


def load_profile_file(path: str | Path) -> Profile:
    loaded = load_yaml_file(path)
    data = loaded.data
    if not isinstance(data, dict):
        raise SpecError(["a cluster profile must be a YAML mapping"], source=str(path))
    data = {"name": Path(path).stem, **data}
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, loaded, Profile), source=str(path)) from None


def load_profile(name: str) -> Profile:
    profiles = available_profiles()
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
    }


__all__ = ["Profile", "Partition", "EnvVar", "load_profile", "available_profiles", "Literal"]
