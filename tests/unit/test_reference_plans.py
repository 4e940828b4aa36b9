"""Every jobs/*.yaml x cluster_profiles/*.yaml pair is validated and planned.

A pair that cannot work fails with the exact message in EXPECTED_FAILURES. A pair that works
has its whole dry-run JSON (the plan and the sbatch script exactly as submitted) compared
with tests/reference_plans/<job>__<profile>.json, byte for byte.

The plans are made machine-independent: the runs root is LMLAUNCH_RUNS_ROOT=/runs, the
interpreter (what ``python: auto`` resolves to) is /opt/lmlaunch/venv/bin/python, HOME and
USER are fixed, and the checkout's path (in resolved data paths) is written as ``<repo>``.

When a plan changes on purpose, re-record and review the diff:

    LMLAUNCH_RECORD=1 pytest tests/unit/test_reference_plans.py
    git diff tests/reference_plans/
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "tests" / "reference_plans"
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.yaml"))
PROFILES = sorted(p.stem for p in (REPO / "cluster_profiles").glob("*.yaml"))
PYTHON = "/opt/lmlaunch/venv/bin/python"
ENVIRON = {"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/home/u", "USER": "u", "PATH": "/usr/bin"}
RECORD = os.environ.get("LMLAUNCH_RECORD") == "1"

_GPU_ON_LOCAL = ("resources.gpus_per_node(8): profile 'local' has no GPUs (its gpus_per_node is 0, a CPU cluster): "
                 "gpus_per_node: 0 runs tasks_per_node tasks on CPU (gloo), or name a GPU cluster's profile")
EXPECTED_FAILURES = {
    ("gpt2-124m", "local"): (
        "jobs/gpt2-124m.yaml: 2 problems:\n"
        f"  - line 6: {_GPU_ON_LOCAL}\n"
        "  - line 7: resources.time(12:00:00) = 720 min is above partition 'low' max_time(2:00:00) = 120 min"
    ),
    ("llama-1b-zero2", "local"): (
        "jobs/llama-1b-zero2.yaml: 2 problems:\n"
        f"  - line 6: {_GPU_ON_LOCAL}\n"
        "  - line 7: resources.time(1-00:00:00) = 1440 min is above partition 'low' max_time(2:00:00) = 120 min"
    ),
    ("llama-1b-container", "local"): (
        "jobs/llama-1b-container.yaml: 2 problems:\n"
        f"  - line 8: {_GPU_ON_LOCAL}\n"
        "  - line 9: resources.time(1-00:00:00) = 1440 min is above partition 'low' max_time(2:00:00) = 120 min"
    ),
    ("llama-7b-zero3", "local"): (
        "jobs/llama-7b-zero3.yaml: 2 problems:\n"
        f"  - line 6: {_GPU_ON_LOCAL}\n"
        "  - line 7: resources.time(2-00:00:00) = 2880 min is above partition 'low' max_time(2:00:00) = 120 min"
    ),
}
PAIRS = [(j, p) for j in JOBS for p in PROFILES]


def lmlaunch(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    ctx = Context(stdout=out, stderr=err, environ=dict(ENVIRON), python=PYTHON)
    cwd = os.getcwd()
    os.chdir(REPO)  # messages name the spec as given: jobs/<name>.yaml
    try:
        code = main(list(argv), ctx)
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def machine_independent(text: str) -> str:
    return text.replace(str(REPO), "<repo>")  # (the controller is not asked: --offline)


@pytest.mark.parametrize(("job", "profile"), PAIRS, ids=[f"{j}@{p}" for j, p in PAIRS])
def test_job_on_profile_matches_reference_plan_or_expected_failure(job, profile, monkeypatch):
    monkeypatch.delenv("LMLAUNCH_DEBUG", raising=False)
    spec = f"jobs/{job}.yaml"
    code, out, err = lmlaunch("validate", spec, "--cluster", profile)
    # a container job's dry run tries its image here, as submit does; these plans' interpreter is a fixed
    # path of no machine (PYTHON), so the trial is what --force skips (the plan is the same)
    tried = "container:" in (REPO / spec).read_text() and (job, profile) not in EXPECTED_FAILURES
    dry_code, dry_out, dry_err = lmlaunch("submit", spec, "--cluster", profile, "--dry-run", "--offline", "--json",
                                          *(["--force"] if tried else []))
    reference = REFERENCE / f"{job}__{profile}.json"
    if (job, profile) in EXPECTED_FAILURES:
        expected = "error: " + EXPECTED_FAILURES[(job, profile)] + "\n"
        assert (code, out, err) == (4, "", expected)
        assert (dry_code, dry_err) == (4, expected)  # --json: the error as JSON on stdout too
        assert json.loads(dry_out)["error"]["message"] == EXPECTED_FAILURES[(job, profile)], dry_out
        assert not reference.exists(), f"stale reference plan {reference.name}"
        return
    assert (code, err) == (0, ""), err
    assert out.startswith(f"ok: {spec} is valid for cluster '{profile}'")
    assert (dry_code, dry_err) == (0, ""), dry_err
    text = machine_independent(dry_out)
    assert json.loads(text)["plan"]["profile"] == profile
    if RECORD:
        reference.write_text(text)
    assert reference.exists(), f"no reference plan: run LMLAUNCH_RECORD=1 pytest {__file__}"
    assert text == reference.read_text(), f"plan differs from {reference}; see module docstring"


def test_no_reference_plan_without_a_job_and_profile():
    expected = {f"{j}__{p}.json" for j, p in PAIRS if (j, p) not in EXPECTED_FAILURES}
    assert {p.name for p in REFERENCE.glob("*.json")} == expected
