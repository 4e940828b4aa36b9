"""`lmlaunch diff` shows exactly the keys two runs differ in (spec, plan, what their attempts ran
on); every attempt records its environment with secrets by name only."""

from __future__ import annotations

import io
import json
from pathlib import Path

from launcher.cli import main
from launcher.context import Context
from launcher.submit.local_run import prepare_local_run
from lmcore.run.rundir import ENVIRONMENT, attempt_logs_dir
from lmtrain.observe.environment_record import REDACTED, visible_environment


def _run(repo: Path, root: Path, name: str, *overrides: str) -> Path:
    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), list(overrides), devices=2, max_steps=20,
                             name=name, environ={"LMLAUNCH_RUNS_ROOT": str(root), "HOME": str(root)},
                             say=lambda *_: None)
    return Path(plan.paths.run_dir)


def _record(run_dir: Path, attempt: int, **changes) -> None:
    rec = {"attempt": attempt, "time": 1.0 * attempt, "job_id": f"local-{run_dir.name}", "nodes": ["n1"],
           "world_size": 2, "packages": {"torch": "2.13.0", "lightning": "2.6.0"}, "cuda": None,
           "plan_sha256": run_dir.name, "env": {"OMP_NUM_THREADS": "1", "SLURM_JOB_ID": run_dir.name,
                                               "LMLAUNCH_RUN_DIR": str(run_dir)}}
    for k, v in changes.items():
        rec[k] = {**rec[k], **v} if isinstance(rec.get(k), dict) else v
    path = attempt_logs_dir(run_dir, attempt) / ENVIRONMENT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))


def _diff(a: Path, b: Path) -> dict:
    out = io.StringIO()
    assert main(["diff", str(a), str(b), "--json"], Context(stdout=out, stderr=out, environ={})) == 0, out.getvalue()
    return json.loads(out.getvalue())


def test_two_runs_of_a_sweep_differ_exactly_in_the_swept_keys(repo, tmp_path):
    a = _run(repo, tmp_path, "lr-a", "optim.lr=0.001")
    b = _run(repo, tmp_path, "lr-b", "optim.lr=0.003", "checkpoint.keep_last=3")
    _record(a, 1)
    _record(b, 1)
    _record(b, 2, packages={"torch": "2.13.1"})  # the last attempt is compared
    got = _diff(a, b)
    keys = [(d["section"], d["key"], d["a"], d["b"]) for d in got["differences"]]
    assert keys == [
        ("spec", "checkpoint.keep_last", 2, 3),
        ("spec", "optim.lr", 0.001, 0.003),
        ("environment", "packages.torch", "2.13.0", "2.13.1"),
    ], keys
    assert got["no_environment_record"] == []
    assert _diff(a, a)["differences"] == []


def test_a_run_without_attempts_is_compared_on_spec_and_plan(repo, tmp_path):
    a = _run(repo, tmp_path, "x-a")
    b = _run(repo, tmp_path, "x-b", "data.micro_batch_size=4")  # the same global batch: 2x accumulation
    got = _diff(a, b)
    assert got["no_environment_record"] == ["x-a", "x-b"]
    keys = {(d["section"], d["key"]): (d["a"], d["b"]) for d in got["differences"]}
    assert keys[("spec", "data.micro_batch_size")] == (8, 4)
    assert keys[("plan", "topology.grad_accum")] == (1, 2)
    assert keys[("plan", "trainer.accumulate_grad_batches")] == (1, 2)
    assert all(section in ("spec", "plan") for section, _ in keys)


def test_secrets_are_recorded_by_name_only():
    env = {"WANDB_API_KEY": "abc", "HF_TOKEN": "t", "MY_PASS": "p", "OMP_NUM_THREADS": "1", "DB_PASSWORD": "x"}
    got = visible_environment(env, ["MY_PASS"])
    assert got == {"DB_PASSWORD": REDACTED, "HF_TOKEN": REDACTED, "MY_PASS": REDACTED, "OMP_NUM_THREADS": "1",
                   "WANDB_API_KEY": REDACTED}
