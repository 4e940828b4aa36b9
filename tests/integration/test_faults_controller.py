"""The SLURM controller goes away: submit fails cleanly and records nothing, a late sbatch is
reconciled instead of submitted twice, and a running job survives a slurmctld restart while
`lmlaunch status` recovers. The outage is a few seconds (others share the cluster); the
controller is restarted in a `finally`."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import waiting
from slurm_helpers import REPO, SMALL_MODEL, faults, pace, wait_nodes_usable, wait_terminal
from waiting import HANG_S

from launcher.localcluster import cluster
from launcher.localcluster.daemons import stop
from launcher.runs import registry as runs
from lmcore.slurm import client as slurm

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")
TINY = ("trainer.max_steps=20", "optim.warmup_steps=2", "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0", "checkpoint.every_n_steps=100", *SMALL_MODEL)


def _job_id(out: str) -> str:
    m = re.search(r"job (\d+)", out)
    assert m, out
    return m.group(1)


def _ledger(run_dir: Path) -> list[dict]:
    p = run_dir / "attempts.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _wait(pred, run_dir: Path, job_id: str, what: str) -> None:
    """Until ``pred()``, while the run's files or its job change."""
    waiting.until(pred, progress=waiting.watching(waiting.tree(run_dir), waiting.job(job_id)), what=what)


def test_late_sbatch_is_reconciled_by_name_and_submit_time_not_submitted_twice(
    slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path, monkeypatch
):
    # an sbatch that queues the job, then does not answer: the client-side limit (3 s) expires
    wrapper_dir = tmp_path / "bin"
    wrapper_dir.mkdir()
    real = slurm.shutil.which("sbatch")
    (wrapper_dir / "sbatch").write_text(f'#!/bin/bash\n"{real}" "$@"\nsleep 60\n')
    (wrapper_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("LMLAUNCH_SBATCH_TIMEOUT_S", "3")

    t0 = time.monotonic()
    r = cli("submit", SPEC, f"name={run_name}", *TINY)
    elapsed = time.monotonic() - t0
    assert r.code == 0, r.err
    job_id = _job_id(r.out)
    own_jobs.append(job_id)
    assert elapsed < 60, elapsed  # did not wait for the wrapper's 60 s sleep

    # exactly one job of that name in SLURM, and it is the one the registry recorded
    named = [j for j in slurm.squeue(user=None, name=run_name)]
    assert [j.job_id for j in named] == [job_id], named
    assert runs.load_record(run_name, lm_env).job_ids == [job_id]
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    folder = run_dir / "submitit"
    assert (folder / f"{job_id}_submitted.pkl").is_file() and (folder / f"{job_id}_submission.sh").is_file()
    assert not [p for p in folder.iterdir() if re.match(r"^[0-9a-f]{32}\.pkl$", p.name)]
    # the adopted job really runs our task: it finds its pickle and starts training
    _wait(lambda: any(e["event"] == "start" for e in _ledger(run_dir)), run_dir, job_id, "the ledger start line")
    slurm.cancel([job_id])


def test_controller_down_then_restarted_submit_refused_running_job_survives_status_recovers(
    slurm_cluster, cli, lm_env, run_name, own_jobs
):
    with faults(pace()):  # it must still train through the controller's outage
        r = cli("submit", SPEC, f"name={run_name}", *TINY, "trainer.max_steps=60", "checkpoint.every_n_steps=10")
    assert r.code == 0, r.err
    job_id = _job_id(r.out)
    own_jobs.append(job_id)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    _wait(lambda: any(e["event"] == "start" for e in _ledger(run_dir)), run_dir, job_id, "the job to start training")

    layout = slurm_cluster
    other = f"{run_name}-b"
    try:
        assert stop(layout.pidfile("slurmctld"), "slurmctld")
        assert not slurm.ping(timeout=3)  # stopped: refused at once
        down = cli("submit", SPEC, f"name={other}", *TINY)
        assert down.code == 3, down.out + down.err
        assert "controller does not answer" in down.err and "nothing was submitted" in down.err
        assert "Traceback" not in down.err
        assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / other).exists()
        assert runs.load_record(other, lm_env) is None
        during = cli("status", run_name)
        assert "Traceback" not in during.err
        assert during.code in (0, 3), during.out + during.err
    finally:
        cluster.ensure_slurmctld(layout, lambda line: None)
    assert slurm.ping(timeout=HANG_S)  # ensure_slurmctld waited for its answer

    # the job kept running (or SLURM requeued it when a node looked lost at the restart: then it
    # resumes from its checkpoint, never from step 0) and finishes; status reads it again
    state = wait_terminal(job_id)
    assert state == "COMPLETED", state
    ledger = _ledger(run_dir)
    trained = [e for e in ledger if e["event"] == "end" and not e.get("skipped")]
    assert trained[-1]["reason"] == "completed" and trained[-1]["end_step"] == 60, ledger
    assert [e["start_step"] for e in ledger if e["event"] == "start"][0] == 0
    assert all(e["start_step"] > 0 for e in ledger if e["event"] == "start" and e["attempt"] > 1), ledger
    wait_nodes_usable()
    after = cli("status", run_name, "--json")
    assert after.code == 0, after.err
    assert job_id in after.out and "completed" in after.out.lower()
