"""`lmlaunch diff RUN_A RUN_B`: only what differs between two runs, key by key: the spec, the plan
(topology, SLURM parameters, environment, DeepSpeed JSON, Trainer arguments), the code snapshot
(git commit, uncommitted changes, each file's hash) and what their last attempts ran on
(packages, CUDA/NCCL, nodes, environment; lmtrain.observe.environment_record writes it).

Values that name the run itself (its directory, its name) are compared as ``<run_dir>`` and
``<name>``, and SLURM's per-job variables are left out, so two runs of one sweep differ exactly
in the keys the sweep changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.runs import snapshot
from lmcore.errors import UserError
from lmcore.run import rundir

VOLATILE_ENV_PREFIXES = ("SLURM_", "SUBMITIT_", "SLURMD_")
VOLATILE_ENV = frozenset({"MASTER_PORT", "LMTRAIN_JOB_ID", "OLDPWD", "_", "SHLVL"})
VOLATILE_RECORD_KEYS = frozenset({"time", "attempt", "job_id", "plan_sha256"})  # per attempt; the plan is compared itself


@dataclass(frozen=True)
class Difference:
    section: str  # spec | plan | environment
    key: str  # dotted path
    a: Any
    b: Any


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": [1, 2]}} -> {"a.b[0]": 1, "a.b[1]": 2}; empty containers stay as values."""
    out: dict[str, Any] = {}
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = value
    return out


def _normalized(value: Any, run_dir: str, name: str) -> Any:
    if isinstance(value, str):
        return "<name>" if value == name else value.replace(run_dir, "<run_dir>")
    return value


def compare(section: str, a: Mapping[str, Any], b: Mapping[str, Any], ids: tuple[tuple[str, str], tuple[str, str]]
            ) -> list[Difference]:
    fa, fb = flatten(a), flatten(b)
    (dir_a, name_a), (dir_b, name_b) = ids
    out = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, "<absent>"), fb.get(key, "<absent>")
        if _normalized(va, dir_a, name_a) != _normalized(vb, dir_b, name_b):
            out.append(Difference(section, key, va, vb))
    return out


@dataclass(frozen=True)
class RunFacts:
    name: str
    run_dir: str
    spec: dict[str, Any]
    plan: dict[str, Any]
    environment: dict[str, Any] | None  # the last attempt's record; None before any attempt
    code: dict[str, Any] | None = None  # the code snapshot: git commit, dirty, sha256 per file


def read_run(name: str, run_dir: Path) -> RunFacts:
    try:
        plan = json.loads(rundir.RunLayout.of(run_dir).plan.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"run '{name}': cannot read {rundir.RunLayout.of(run_dir).plan}: {exc}") from None
    records = rundir.environment_records(run_dir)
    env = records[max(records)] if records else None
    if env is not None:
        env = {k: v for k, v in env.items() if k not in VOLATILE_RECORD_KEYS}
        env["env"] = {k: v for k, v in (env.get("env") or {}).items()
                      if k not in VOLATILE_ENV and not k.startswith(VOLATILE_ENV_PREFIXES)}
    spec = plan.pop("spec", {})
    snap = snapshot.read(run_dir)
    code: dict[str, Any] | None = None
    if snap is not None:
        git: dict[str, Any] = {k: v for k, v in (snap.git or {}).items() if k != "patch_file"}
        if snap.git and snap.git.get("patch_file"):
            patch = rundir.RunLayout.of(run_dir).code / str(snap.git["patch_file"])
            git["patch_sha256"] = hashlib.sha256(patch.read_bytes()).hexdigest() if patch.exists() else None
        code = {"git": git, "files": snap.files}
    return RunFacts(name=name, run_dir=str(run_dir), spec=spec, plan=plan, environment=env, code=code)


def diff_runs(a: RunFacts, b: RunFacts) -> list[Difference]:
    ids = ((a.run_dir, a.name), (b.run_dir, b.name))
    out = compare("spec", a.spec, b.spec, ids) + compare("plan", a.plan, b.plan, ids)
    if a.code is not None and b.code is not None:
        out += compare("code", a.code, b.code, ids)
    if a.environment is not None and b.environment is not None:
        out += compare("environment", a.environment, b.environment, ids)
    return out
