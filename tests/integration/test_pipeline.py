"""Pipelines on the real local cluster: a train -> eval pipeline runs eval after train, on the
checkpoint train left, and eval's result shows in `status` and `history`; a pipeline whose train
fails leaves eval as never starting, which `cancel` clears."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_helpers import HELD, REPO, wait_reason, wait_terminal

from lmcore.slurm import client as slurm

SMALL = ["resources.nodes=1", "trainer.max_steps=6", "optim.warmup_steps=1", "checkpoint.every_n_steps=100",
         "trainer.val_check_interval=null", "preemption.max_crash_retries=0"]


def _pipeline(tmp_path: Path, name: str, train_extra: list[str]) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({"name": name, "stages": [
        {"name": "train", "spec": str(REPO / "jobs" / "tiny-cpu.yaml"), "overrides": [*SMALL, *train_extra]},
        {"name": "eval", "spec": str(REPO / "jobs" / "tiny-cpu.yaml"), "after": ["train"],
         "overrides": [*SMALL, "eval.checkpoint=${train.checkpoint}", "eval.max_batches=4"]},
    ]}))
    return path


def _status(cli, name: str) -> dict:
    r = cli("status", name, "--json")
    assert r.code == 0, r.err
    return next(x for x in json.loads(r.out)["runs"] if x["name"] == name)


def test_train_then_eval_runs_eval_on_trains_checkpoint(slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path):
    # train is held until eval is seen waiting for it: it cannot complete before eval is queued
    r = cli("pipeline", str(_pipeline(tmp_path, run_name, [HELD])))
    assert r.code == 0, r.out + r.err
    jobs = dict(line.split(": submitted run ")[0:1] + [line.split("job ")[1].split()[0]]
                for line in r.out.splitlines() if ": submitted run " in line)
    own_jobs.extend(jobs.values())
    wait_reason(jobs["eval"], "Dependency")
    slurm.hold(jobs["train"], release=True)
    assert wait_terminal(jobs["train"]) == "COMPLETED"
    assert wait_terminal(jobs["eval"]) == "COMPLETED"
    assert slurm.parse_time(slurm.show_job(jobs["eval"])["StartTime"]) >= slurm.parse_time(
        slurm.show_job(jobs["train"])["EndTime"])
    runs_root = Path(lm_env["LMLAUNCH_RUNS_ROOT"])
    ledger = [json.loads(x) for x in (runs_root / f"{run_name}.eval" / "attempts.jsonl").read_text().splitlines()]
    result = next(e for e in ledger if e["event"] == "eval")
    assert result["checkpoint"] == str(runs_root / f"{run_name}.train" / "checkpoints" / "step-6"), result
    row = _status(cli, f"{run_name}.eval")
    assert row["state"] == "COMPLETED" and row["loss"] == result["val_loss"], row
    assert row["note"].startswith(f"eval of step-6: val_loss {result['val_loss']:.4f}"), row
    h = cli("history", f"{run_name}.eval")
    assert h.code == 0 and "eval of step-6: val_loss" in h.out, h.out


def test_a_failed_train_leaves_eval_never_starting_and_cancel_clears_it(slurm_cluster, cli, lm_env, run_name, own_jobs,
                                                                         tmp_path):
    # the train stage crashes at its start (no data there); no crash retry
    # held until the pipeline has queued eval behind it (a train failed already would refuse eval)
    store = tmp_path / "store"  # the data, there when submitted (validate checks it), gone when it starts
    store.symlink_to(REPO / "data" / "prepared" / "tiny")
    r = cli("pipeline", str(_pipeline(tmp_path, run_name, [HELD, f"data.path={store}"])))
    assert r.code == 0, r.out + r.err
    store.unlink()
    jobs = {line.split(":")[0]: line.split("job ")[1].split()[0] for line in r.out.splitlines() if "submitted run" in line}
    own_jobs.extend(jobs.values())
    slurm.hold(jobs["train"], release=True)
    assert wait_terminal(jobs["train"]) == "FAILED"
    wait_reason(jobs["eval"], "DependencyNeverSatisfied")
    row = _status(cli, f"{run_name}.eval")
    assert row["reason"] == "DependencyNeverSatisfied" and "never starts" in row["note"], row
    assert cli("cancel", f"{run_name}.eval").code == 0
    assert wait_terminal(jobs["eval"]) == "CANCELLED"


def test_a_pipeline_with_an_invalid_stage_submits_nothing(slurm_cluster, cli, lm_env, run_name, tmp_path):
    path = _pipeline(tmp_path, run_name, [])
    d = json.loads(path.read_text())
    d["stages"][1]["overrides"].append("trainer.max_steps=-3")
    path.write_text(json.dumps(d))
    r = cli("pipeline", str(path))
    assert r.code == 4 and "pipeline stage 'eval'" in r.err and "trainer.max_steps" in r.err, r.out + r.err
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / f"{run_name}.train").exists()
    assert cli("status", f"{run_name}.train").code != 0
