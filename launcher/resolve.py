"""From CLI arguments to a validated spec, profile and plan (the shared front of validate,
submit and run). Reads files; the planning itself stays pure in launcher.plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from launcher.jobfile import load_job
from launcher.plan import LaunchPlan, make_plan
from launcher.profiles import Profile, load_profile
from launcher.spec import JobSpec


@dataclass(frozen=True)
class Resolved:
    spec: JobSpec
    profile: Profile
    plan: LaunchPlan


def runs_root_for(profile: Profile, environ: dict[str, str] | None = None) -> str:
    """LMLAUNCH_RUNS_ROOT overrides the profile's runs_root (tests, scratch space)."""
    env = os.environ if environ is None else environ
    root = env.get("LMLAUNCH_RUNS_ROOT") or str(profile.runs_root_path)
    return str(Path(os.path.expanduser(root)).absolute())


def resolve(
    spec_path: str,
    overrides: list[str] | None = None,
    cluster: str | None = None,
    environ: dict[str, str] | None = None,
) -> Resolved:
    spec = load_job(spec_path, overrides or [])
    if cluster:
        spec = spec.model_copy(update={"cluster": cluster})
    profile = load_profile(spec.cluster)
    plan = make_plan(spec, profile, runs_root=runs_root_for(profile, environ))
    return Resolved(spec=spec, profile=profile, plan=plan)
