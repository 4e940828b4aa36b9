"""Sweeps on the real local cluster: a 4-point sweep with --max-parallel 2 is one SLURM array that
never runs more than 2 points at once and completes all 4; preempting one running point requeues
that array task only, and it resumes at the step it stopped (0 steps lost); the sweep's status
row, results table and report (4 curves) follow; `cancel SWEEP` cancels every point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import waiting
from preempt_helpers import is_held
from slurm_helpers import REPO, faults, gate, wait_reason

from lmcore import jsonlines
from lmcore.run import rundir
from lmcore.slurm import admin as rehearsal, client as slurm

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")
STEPS = 40
POINTS = 4  # 2 learning rates x 2 minimum rates, at most 2 at once
SMALL = ["resources.nodes=1", f"trainer.max_steps={STEPS}", "optim.warmup_steps=1", "trainer.log_every_n_steps=1",
         "checkpoint.every_n_steps=100", "trainer.val_check_interval=20"]


def _sweep_file(tmp_path: Path, name: str) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"name": name, "max_parallel": 2, "grid": {"optim.lr": [0.001, 0.01]},
                                "zip": {"optim.min_lr": [0.0001, 0.0002]}}))
    return str(path)


def _ledger(run_dir: Path) -> list[dict]:
    return jsonlines.read_jsonl(run_dir / rundir.LEDGER)


def test_a_throttled_sweep_runs_every_point_and_one_preempted_point_resumes_alone(
        slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path):
    # Every point is held at step 10 until the test has preempted one held there (SIGTERM opens its
    # gate) and released the rest: the one preempted cannot complete first.
    released = tmp_path / "released"
    with faults(gate("train.batch_end", released, step=10, attempt=1)):
        r = cli("sweep", SPEC, _sweep_file(tmp_path, run_name), *SMALL, "--json")
    assert r.code == 0, r.out + r.err
    sub = json.loads(r.out)
    assert len(sub["arrays"]) == 1 and len(sub["points"]) == POINTS
    array = sub["arrays"][0]
    own_jobs.append(array)
    runs_root = Path(lm_env["LMLAUNCH_RUNS_ROOT"])
    dirs = {p["run"]: runs_root / p["run"] for p in sub["points"]}

    most, busiest, preempted = 0, "", None

    def all_completed() -> bool:
        nonlocal most, busiest, preempted
        # one squeue call, one moment (two calls once saw a task end and the next start between them).
        # RUNNING only: a task that is COMPLETING no longer counts against the throttle (SLURM
        # starts the next one then) and its processes have exited
        jobs = [j for j in slurm.squeue([array, *(p["job_id"] for p in sub["points"])])
                if j.job_id.startswith(f"{array}_")]
        running = {j.job_id for j in jobs if j.state.split()[0].rstrip("+") == "RUNNING"}
        if len(running) > most:
            most, busiest = len(running), ", ".join(f"{j.job_id} {j.state}" for j in jobs)
        if preempted is None:
            for p in sub["points"]:
                if p["job_id"] in running and is_held(dirs[p["run"]]):
                    preempted = p  # SIGTERM to that array task's processes, as a preemption
                    rehearsal.signal_steps(p["job_id"], "TERM")
                    released.touch()
                    break
        ended = [p for p in sub["points"] if any(e.get("event") == "end" and e.get("reason") == "completed"
                                                 for e in _ledger(dirs[p["run"]]))]
        if len(ended) == POINTS:
            return True
        pending = [j.job_id for j in jobs if slurm.state_group(j.state) == "queued" and "BeginTime" in (j.reason or "")]
        for jid in pending:  # a requeued task waits for SLURM's BeginTime (~2 min): start it now
            if rehearsal.ready_to_start(jid):
                rehearsal.start_now(jid)
        return False

    waiting.until(all_completed, poll=1.0, progress=waiting.watching(waiting.tree(*dirs.values()), waiting.queue()),
                  what=f"every point of sweep {run_name} completed")
    assert most <= 2, f"{most} points ran at once: {busiest}"
    assert preempted is not None
    for p in sub["points"]:
        ledger = _ledger(dirs[p["run"]])
        ends = [e for e in ledger if e.get("event") == "end"]
        starts = [e for e in ledger if e.get("event") == "start"]
        assert ends and ends[-1]["reason"] == "completed" and ends[-1]["end_step"] == STEPS, (p, ends)
        if p is preempted:
            assert [e["reason"] for e in ends] == ["preempted", "completed"], ends
            assert starts[1]["start_step"] == ends[0]["end_step"] > 0, (starts, ends)  # 0 steps lost
            assert starts[1]["job_id"] == p["job_id"] and starts[1]["restart_count"] == 1
        else:
            assert len(starts) == 1 and starts[0]["job_id"] == p["job_id"], (p, starts)  # untouched

    # the ledgers say completed; SLURM may still be ending the last task
    waiting.until(lambda: not any(slurm.is_active(j.state) for j in slurm.squeue([array])), poll=1.0,
                  progress=waiting.queue([array]), what=f"array {array} gone from the queue")
    row = next(x for x in json.loads(cli("status", "--json").out)["runs"] if x["name"] == run_name)
    assert row["state"] == f"{POINTS} COMPLETED" and f"sweep of {POINTS} points" in row["note"], row
    res = json.loads(cli("sweep", "results", run_name, "--json").out)["points"]
    assert [x["run"] for x in res] == [f"{run_name}.{i}" for i in range(POINTS)]
    assert all(x["state"] == "completed" and x["step"] == STEPS and x["val_loss"] is not None for x in res), res
    assert {x["optim.lr"] for x in res} == {0.001, 0.01}
    rep = cli("report", run_name, "-o", str(tmp_path / "sweep.png"), "--json")
    assert rep.code == 0, rep.err
    summary = json.loads(rep.out)
    assert summary["points"] == POINTS and len(summary["final_loss"]) == POINTS and summary["best"] in dirs
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.both_versions
def test_cancelling_a_sweep_cancels_every_point(slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path):
    dry = cli("sweep", SPEC, _sweep_file(tmp_path, run_name), *SMALL, "trainer.max_steps=100000", "--dry-run", "--json")
    assert dry.code == 0, dry.out + dry.err
    r = cli("sweep", SPEC, _sweep_file(tmp_path, run_name), *SMALL, "trainer.max_steps=100000", "--json")
    assert r.code == 0, r.out + r.err
    sub = json.loads(r.out)
    own_jobs.extend(sub["arrays"])
    (array,) = sub["arrays"]
    # the array's script as sbatch received it is the one the dry run printed (launcher.submit.script)
    submitted = list((Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name / "submitit").glob("*_submission.sh"))
    assert len(submitted) == 1 and submitted[0].read_text() == json.loads(dry.out)["script"], submitted
    def two_running() -> list:
        running = [j for j in slurm.squeue([array]) if slurm.state_group(j.state) == "running"]
        return running if len(running) >= 2 else []

    running = waiting.until(two_running, progress=waiting.queue([array]), what=f"two tasks of array {array} running",
                            explain=lambda: f"{slurm.squeue([array])}")
    # the throttle (max_parallel 2) holds the other 2 back: SLURM says why
    assert slurm.show_job(array)["ArrayTaskThrottle"] == "2" and len(running) == 2, slurm.squeue([array])
    wait_reason(array, "JobArrayTaskLimit")  # the two running hold it (100000 steps): SLURM may say so late
    c = cli("cancel", run_name, "--json")
    assert c.code == 0, c.err
    assert len(json.loads(c.out)["points"]) == POINTS
    waiting.until(lambda: not any(slurm.is_active(j.state) for j in slurm.squeue(sub["arrays"])), poll=1.0,
                  progress=waiting.queue(sub["arrays"]), what="the cancelled sweep's tasks gone")
    assert not [j for j in slurm.squeue(sub["arrays"]) if slurm.is_active(j.state)]
    for p in sub["points"]:
        assert (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / p["run"] / rundir.CANCELLED).exists()
