"""One run lifecycle (launcher.submit.lifecycle) for `submit` and `run --local`: new / resume /
archive, the CANCELLED mark, and a rollback that leaves nothing half-done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.planning.resolve import resolve
from launcher.runs import registry as runs
from launcher.submit import lifecycle
from lmcore.errors import UserError


def _plan(repo, runs_root: Path, *overrides: str):
    environ = {"LMLAUNCH_RUNS_ROOT": str(runs_root), "HOME": "/home/u", "USER": "u"}
    return resolve(str(repo / "jobs" / "tiny-cpu.yaml"), list(overrides), cluster="local", environ=environ).plan


def test_an_existing_run_needs_resume_or_new(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    with pytest.raises(UserError, match=r"already exists .*--resume.*--new"):
        lifecycle.plan_opening(plan)
    with pytest.raises(UserError, match="exclude each other"):
        lifecycle.plan_opening(plan, new=True, resume=True)
    other = _plan(repo, tmp_path, "name=other")
    with pytest.raises(UserError, match="no run directory"):
        lifecycle.plan_opening(other, resume=True)
    record = runs.RunRecord(name="other", profile="local", run_dir=other.paths.run_dir, spec_path=None,
                            job_ids=["12"])
    with pytest.raises(UserError, match=r"already exists .*jobs 12"):  # registered, directory gone
        lifecycle.plan_opening(other, record=record)


def test_a_resume_takes_the_cancelled_mark_away_and_a_rollback_puts_everything_back(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    lifecycle.mark_cancelled(run_dir, user="u", job_ids=["7"])
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    resumed = _plan(repo, tmp_path, "trainer.max_steps=300")
    opening = lifecycle.plan_opening(resumed, resume=True)
    opening.apply()
    assert not (run_dir / "CANCELLED").exists()
    assert any("CANCELLED mark" in n for n in opening.notes)
    assert json.loads(Path(resumed.paths.plan_json).read_text())["trainer"]["max_steps"] == 300
    opening.rollback()  # e.g. sbatch refused the job
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_new_archives_and_rollback_restores(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    (run_dir / "attempts.jsonl").write_text('{"event": "start", "attempt": 1}\n')
    opening = lifecycle.plan_opening(plan, new=True)
    opening.apply()
    archived = [p for p in run_dir.parent.iterdir() if p.name.startswith("tiny-cpu.archived-")]
    assert len(archived) == 1 and (archived[0] / "attempts.jsonl").exists()
    assert not (run_dir / "attempts.jsonl").exists() and (run_dir / "plan.json").exists()
    opening.rollback()
    assert (run_dir / "attempts.jsonl").exists()
    assert not [p for p in run_dir.parent.iterdir() if p.name.startswith("tiny-cpu.archived-")]


def test_a_local_run_resumes_a_cancelled_run_as_submit_does(repo, tmp_path):
    from launcher.submit.local_run import prepare_local_run

    said: list[str] = []
    env = {"LMLAUNCH_RUNS_ROOT": str(tmp_path), "HOME": str(tmp_path)}
    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), [], devices=1, max_steps=4, name="loc",
                             environ=env, say=said.append)
    run_dir = Path(plan.paths.run_dir)
    lifecycle.mark_cancelled(run_dir, user="u", job_ids=[])
    with pytest.raises(UserError, match="already exists"):
        prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), [], devices=1, max_steps=4, name="loc",
                          environ=env, say=said.append)
    prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), [], devices=1, max_steps=4, name="loc",
                      environ=env, resume=True, say=said.append)
    assert not (run_dir / "CANCELLED").exists()
    assert any("CANCELLED mark" in s for s in said), said
