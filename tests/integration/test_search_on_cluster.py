"""A search on the real local cluster (`lmlaunch sweep SPEC SEARCH.yaml` with search: optuna): 8
trials over the tiny job's learning rate and warmup, at most 2 at once, a median pruner, the
study on the cluster's MariaDB. While it runs: one running trial is preempted (SIGTERM to its
steps, as SLURM's preemption sends) and finishes as the same trial from its checkpoint; the driver
is killed with SIGKILL mid-search and `lmlaunch sweep resume` finishes it. At no moment are more
than 2 trials queued or running; exactly 8 trials, each one run with one job; at least one
pruned early (PRUNED in status, its checkpoint kept); the best trial's objective is its run's
own last logged val_loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import waiting
from preempt_helpers import is_held, ledger
from slurm_helpers import REPO, gate

from lmcore import jsonlines
from lmcore.run import rundir
from lmcore.slurm import admin as rehearsal, client as slurm

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")
STEPS = 24
TRIALS = 8
SMALL = ["resources.nodes=1", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=4", "trainer.log_every_n_steps=2",
         "optim.min_lr=1.0e-5", "checkpoint.every_n_steps=100", "trainer.global_batch_size=8"]
CLI = [sys.executable, "-c", "import sys; from launcher.cli import main; sys.exit(main())"]


def _search_file(tmp_path: Path, name: str) -> str:
    path = tmp_path / "search.yaml"
    path.write_text(json.dumps({
        "name": name, "search": "optuna", "trials": TRIALS, "max_parallel": 2,
        "objective": {"metric": "val_loss", "at": "last"},
        "sampler": {"name": "tpe", "seed": 0},
        "pruner": {"name": "median", "startup_trials": 2, "warmup_steps": 4},
        "params": {"optim.lr": {"float": [1.0e-4, 3.0e-2], "log": True}, "optim.warmup_steps": {"int": [0, 8]}},
    }))
    return str(path)


def test_a_search_prunes_keeps_two_at_once_survives_a_preemption_and_a_killed_driver(
        slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path):
    # Every trial is held at step 10 until the test has preempted one held there (SIGTERM opens its
    # gate) and released the rest: the one preempted cannot end, be pruned or complete first.
    released = tmp_path / "released"
    env = {**lm_env, "LMLAUNCH_SEARCH_POLL_S": "1",
           "LMLAUNCH_FAULTS": json.dumps([gate("train.batch_end", released, step=10, attempt=1)])}
    runs_root = Path(lm_env["LMLAUNCH_RUNS_ROOT"])
    log = (tmp_path / "driver.out").open("w")
    driver = subprocess.Popen([*CLI, "sweep", SPEC, _search_file(tmp_path, run_name), *SMALL], env=env,
                              stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    resumed: subprocess.Popen | None = None
    most, busiest, preempted, user = 0, "", None, slurm.user_name()

    def trial_jobs() -> list[slurm.QueuedJob]:
        return [j for j in slurm.squeue(user=user) if j.name.startswith(f"{run_name}.")]

    def ended_trials() -> int:
        return sum(1 for d in runs_root.glob(f"{run_name}.*")
                   if any(e.get("event") == "end" and e.get("reason") in ("completed", "pruned") for e in ledger(d)))

    def finished():
        nonlocal most, busiest, preempted, resumed
        jobs = trial_jobs()
        live = [j for j in jobs if slurm.is_active(j.state)]
        own_jobs.extend(j.job_id for j in jobs if j.job_id not in own_jobs)
        if len(live) > most:
            most, busiest = len(live), ", ".join(f"{j.name} {j.job_id} {j.state}" for j in live)
        if preempted is None:
            for j in live:
                if slurm.state_group(j.state) == "running" and is_held(runs_root / j.name):
                    preempted = j  # SIGTERM to its steps, as a preemption
                    rehearsal.signal_steps(j.job_id, "TERM")
                    released.touch()
                    break
        for j in live:  # a requeued trial waits for SLURM's BeginTime (~2 min): start it now
            if slurm.state_group(j.state) == "queued" and "BeginTime" in (j.reason or "") \
                    and rehearsal.ready_to_start(j.job_id):
                rehearsal.start_now(j.job_id)
        if resumed is None and driver.poll() is None and ended_trials() >= 3 and live:
            driver.send_signal(signal.SIGKILL)  # mid-search: trials in flight, the study half asked
            driver.wait()
            resumed = subprocess.Popen([*CLI, "sweep", "resume", run_name], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=str(REPO))
        assert driver.poll() in (None, -signal.SIGKILL), (tmp_path / "driver.out").read_text()
        return resumed is not None and resumed.poll() is not None

    try:
        waiting.until(finished, poll=1.0,
                      progress=waiting.watching(waiting.tree(runs_root), lambda: (tmp_path / "driver.out").stat().st_size),
                      what=f"search {run_name} finished by its resumed driver",
                      explain=lambda: (tmp_path / "driver.out").read_text()[-3000:])
    finally:
        for p in (driver, resumed):
            if p is not None and p.poll() is None:
                p.kill()
        log.close()
    said = (tmp_path / "driver.out").read_text()
    assert resumed.returncode == 0, said
    assert most <= 2, f"{most} trials queued or running at once: {busiest}"
    assert preempted is not None, said
    assert f"search '{run_name}' done: {TRIALS} trials" in said, said

    rows = json.loads(cli("sweep", "results", run_name, "--json").out)["trials"]
    assert [r["trial"] for r in rows] == list(range(TRIALS)), rows
    assert {r["state"] for r in rows} <= {"complete", "pruned"}, rows
    pruned = [r for r in rows if r["state"] == "pruned"]
    assert pruned and all(r["pruned_at"] is not None and r["pruned_at"] < STEPS for r in pruned), rows
    params = {(r["optim.lr"], r["optim.warmup_steps"]) for r in rows}
    assert len(params) == TRIALS, rows  # the resumed driver asked new values, not its first draws again
    (best,) = [r for r in rows if r["best"]]
    vals = [b["val_loss"] for b in jsonlines.read_jsonl(runs_root / best["run"] / rundir.HEARTBEAT)
            if b.get("event") == "val"]
    assert best["objective"] == vals[-1], (best, vals)
    assert best["objective"] == min(r["objective"] for r in rows if r["state"] == "complete")

    # each trial one run with one job (never submitted twice, not even by the killed driver)
    for r in rows:
        run_dir = runs_root / r["run"]
        starts = [e for e in ledger(run_dir) if e.get("event") == "start"]
        assert len({s["job_id"] for s in starts}) == 1, (r, starts)
        ends = [e for e in ledger(run_dir) if e.get("event") == "end"]
        if r["run"] == preempted.name:  # the same trial, resumed where it stopped: 0 steps lost
            assert ends[0]["reason"] == "preempted" and ends[-1]["reason"] in ("completed", "pruned"), ends
            assert starts[1]["start_step"] == ends[0]["end_step"] > 0, (starts, ends)
        if r["state"] == "pruned":
            assert ends[-1]["reason"] == "pruned" and not ends[-1]["requeued"], ends
            assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
        else:
            assert ends[-1]["reason"] == "completed" and ends[-1]["end_step"] == STEPS, ends

    waiting.until(lambda: not any(slurm.is_active(j.state) for j in trial_jobs()), poll=1.0,
                  progress=waiting.queue(), what=f"search {run_name}'s jobs gone from the queue")
    status = json.loads(cli("status", run_name, "--json").out)["runs"]
    assert sorted(x["state"] for x in status if x["state"] == "PRUNED") == ["PRUNED"] * len(pruned), status
    rep = cli("report", run_name, "-o", str(tmp_path / "search.png"), "--json")
    assert rep.code == 0, rep.err
    assert json.loads(rep.out)["best"] == best["run"] and len(json.loads(rep.out)["trials"]) == TRIALS
    assert os.path.getsize(tmp_path / "search.png") > 10_000
