"""`lmlaunch status --json`, `cancel` and `history` against the real local cluster: a running
run, a pending run (cancelled through `lmlaunch cancel`), the same run preempted by an exclusive
job on the `high` partition and requeued (the cluster sending the user signal before SIGTERM, or
SIGTERM only), and finally finished, each with the right state, reason, attempt and step. Both
tests run on both SLURM versions (scripts/test.sh's phase 3)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import waiting
from preempt_helpers import held_at, user_signal_on_preemption
from slurm_helpers import (
    REPO,
    SMALL_MODEL,
    faults,
    gate,
    pace,
    requeues_once_more_after_preemption,
    wait_for,
    wait_terminal,
)
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmcore.slurm import admin as rehearsal, client as slurm

MAX_STEPS = 150
OVERRIDES = (
    "resources.nodes=1",  # one node: the preempting job then needs that node only
    f"trainer.max_steps={MAX_STEPS}",
    "optim.warmup_steps=3",
    "trainer.val_check_interval=30",
    "trainer.log_every_n_steps=5",
    "checkpoint.every_n_steps=10",
    *SMALL_MODEL,
)


def _status(cli, *args) -> dict:
    r = cli("status", "--json", "--all", *args)
    assert r.code == 0, r.err
    return json.loads(r.out)


def _row(cli, name) -> dict:
    data = _status(cli, name)
    assert data["slurm"]["reachable"], data
    (row,) = data["runs"]
    return row


def _wait_row(cli, name, pred, what: str) -> dict:
    """Until ``name``'s status row satisfies ``pred``, while the row changes (steps, loss, state,
    reason) or the cluster's queue does."""
    row: dict = {}

    def seen() -> dict | None:
        row.clear()
        row.update(_row(cli, name))
        return dict(row) if pred(row) else None

    return waiting.until(seen, poll=1.0, progress=waiting.watching(lambda: json.dumps(row, sort_keys=True), waiting.queue()),
                         what=f"{name}: {what}", explain=lambda: f"last row {row}")


def _submit(cli, name, *extra, holds: tuple[dict, ...] = ()) -> str:
    with faults(pace(), *holds):  # steps as long as tiny-cpu's, without their CPU: the test acts on a running run
        r = cli("submit", str(REPO / "jobs" / "tiny-cpu.yaml"), f"name={name}", *OVERRIDES, *extra)
    assert r.code == 0, r.err
    assert f"lmlaunch status {name}" in r.out and f"lmlaunch cancel {name}" in r.out  # next commands
    return re.search(r"job (\d+)", r.out).group(1)


def _sbatch(*args: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=HANG_S,
                          env=slurm.slurm_env())
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


@pytest.mark.both_versions
def test_status_follows_a_run_through_running_pending_preempted_requeued_and_finished(
    slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path
):
    """A cluster that sends SIGTERM only on preemption (the local cluster's default); the warning
    signal's path to the same stop is test_preempt_resume.py's first test, which status does not
    tell apart."""
    with user_signal_on_preemption(False):
        _follow_a_run(cli, lm_env, run_name, own_jobs, tmp_path, False)


def _follow_a_run(cli, lm_env, run_name, own_jobs, tmp_path: Path, user_signal: bool) -> None:
    # held at step 12 until the preemption (it cannot finish first), then in its second attempt at
    # step 20 until the run beside it was seen pending and cancelled (it keeps the node meanwhile)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    released = tmp_path / "released"
    job = _submit(cli, run_name, holds=(held_at(12), gate("train.batch_end", released, step=20, attempt=2)))
    own_jobs.append(job)

    # running: steps advance and a checkpoint is written
    row = _wait_row(cli, run_name, lambda r: r["state"] == "RUNNING" and (r["checkpoint_step"] or 0) >= 10,
                    "RUNNING with a checkpoint")
    assert (row["job_id"], row["group"], row["reason"], row["attempt"], row["requeued"]) == (job, "running", None, 1, False)
    assert row["step"] >= 10 and row["max_steps"] == MAX_STEPS and row["nodes"] == 1 and row["loss"] is not None
    assert row["time_limit"] == "20:00" and row["tokens_per_s"] > 0

    # preempted and requeued: an exclusive job on `high` takes its node, the runtime checkpoints
    # on SIGTERM and requeues the job, which waits for SLURM's BeginTime as the next attempt
    r = cli("preempt", run_name, "--mode", "requeue", "--json")
    assert r.code == 0, r.out + r.err
    assert json.loads(r.out)["requeued"], r.out
    row = _wait_row(cli, run_name, lambda r: r["state"] == "PENDING" and r["reason"] == "BeginTime",
                    "PENDING (BeginTime) after the preemption")
    assert (row["job_id"], row["group"], row["attempt"], row["requeued"]) == (job, "queued", 2, True), row
    stop = json.loads((run_dir / "attempts.jsonl").read_text().splitlines()[-1])
    assert (stop["event"], stop["reason"]) == ("end", "preempted"), stop
    # with the user signal, SIGTERM follows it at once: the stop may be agreed before it lands
    assert (stop["signal"].startswith("SIGUSR2") if user_signal else stop["signal"] == "SIGTERM"), stop
    assert row["step"] == row["checkpoint_step"] == stop["end_step"] < MAX_STEPS, row
    wait_for(job, {"running"}, poll=1.0, start_requeued=True)  # skip the ~2 min delay
    row = _wait_row(cli, run_name, lambda r: r["state"] == "RUNNING" and r["step"] > stop["end_step"],
                    "RUNNING again past the stop step")
    assert (row["attempt"], row["requeued"], row["group"]) == (2, True, "running"), row

    # pending: a run that needs every CPU of both nodes cannot start beside it
    pending_name = run_name + "-pd"
    pjob = _submit(cli, pending_name, "resources.nodes=2", "resources.cpus_per_task=4")
    own_jobs.append(pjob)
    prow = _wait_row(cli, pending_name, lambda r: r["state"] == "PENDING" and r["reason"], "PENDING with a reason")
    assert prow["reason"] in ("Resources", "Priority"), prow
    assert (prow["attempt"], prow["step"], prow["group"]) == (1, None, "queued")
    # ... and cancelled: marker first, then scancel, registry and ledger updated
    r = cli("cancel", pending_name, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["cancelled_jobs"] == [pjob]
    pdir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / pending_name
    assert json.loads((pdir / "CANCELLED").read_text())["job_ids"] == [pjob]
    ledger = [json.loads(x) for x in (pdir / "attempts.jsonl").read_text().splitlines()]
    assert ledger[-1]["event"] == "cancel_requested" and ledger[-1]["job_ids"] == [pjob]
    crow = _wait_row(cli, pending_name, lambda r: r["state"] == "CANCELLED", "CANCELLED")
    assert crow["group"] == "cancelled"
    released.touch()

    # finished: it trains to max_steps
    assert wait_terminal(job) == "COMPLETED"
    row = _wait_row(cli, run_name, lambda r: r["state"] == "COMPLETED" and r["step"] == MAX_STEPS, "COMPLETED")
    # SLURM 24.11 requeues a preempted job once more after its last run: an attempt training nothing
    extra = 1 if requeues_once_more_after_preemption() else 0
    assert (row["attempt"], row["requeued"], row["group"], row["eta_s"]) == (2 + extra, True, "completed", None)
    assert (run_dir / "DONE").exists()

    # history: the preempted attempt (no step lost: the next one starts at its stop step) and
    # the completed one, queue waits from sacct -D, goodput from the heartbeat
    r = cli("history", run_name, "--json")
    assert r.code == 0, r.err
    h = json.loads(r.out)
    a1, a2, *more = h["attempts"]
    assert len(more) == extra, h["attempts"]
    for a in more:
        assert (a["reason"], a["start_step"], a["end_step"]) == ("completed", MAX_STEPS, MAX_STEPS), a
        assert "the run already finished (DONE marker)" in a["detail"], a
    assert (a1["attempt"], a1["job_id"], a1["reason"], a1["end_step"], a1["requeued"]) == (
        1, job, "preempted", stop["end_step"], True)
    assert a1["steps_lost"] == 0 and a2["start_step"] == stop["end_step"]
    assert (a2["attempt"], a2["job_id"], a2["reason"], a2["end_step"]) == (2, job, "completed", MAX_STEPS)
    assert a1["queue_wait_s"] is not None and 0 < h["goodput"] <= 1

    # logs: both attempts in order, each after its marker line
    r = cli("logs", run_name)
    assert r.code == 0
    markers = [line for line in r.out.splitlines() if line.startswith("──── attempt ")]
    assert [m.split(" · ")[0:2] for m in markers][:2] == [["──── attempt 1", f"job {job}"],
                                                          ["──── attempt 2", f"job {job}"]], markers
    assert len(markers) in (2, 2 + extra), markers  # the extra attempt may have written no log
    assert r.out.splitlines()[0] == markers[0]


@pytest.mark.both_versions
def test_status_shows_a_preempted_job_requeued_pending_on_begin_time_as_the_next_attempt(
    slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path
):
    """SLURM's side of preemption, independent of the training runtime: a registered run whose
    job (a plain sleep) is preempted by an exclusive job on `high` and requeued by SLURM."""
    from launcher.runs import registry as runs

    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    (run_dir / "metrics").mkdir(parents=True)
    job = _sbatch("-J", run_name, "-p", "low", "-N", "1", "-n", "1", "--requeue", "-t", "5",
                  "-o", str(tmp_path / "low-%j.out"), "--wrap", "sleep 600")
    own_jobs.append(job)
    runs.save_record(runs.RunRecord(name=run_name, profile="local", run_dir=str(run_dir), spec_path=None,
                                    job_ids=[job], submitted_at=[time.time()], max_steps=100), lm_env)
    wait_for(job, {"running"}, poll=1.0)
    now = time.time()
    (run_dir / "attempts.jsonl").write_text(json.dumps(
        {"event": "start", "attempt": 1, "job_id": job, "time": now, "start_step": 0, "nodes": ["n1"]}) + "\n")
    (run_dir / "metrics" / "heartbeat.jsonl").write_text("".join(json.dumps(
        {"time": now + i, "event": "step", "step": 10 * i, "max_steps": 100, "loss": 4.0, "tokens_per_s": 100.0,
         "attempt": 1, "job_id": job}) + "\n" for i in range(1, 4)))
    row = _row(cli, run_name)
    assert (row["state"], row["attempt"], row["step"], row["requeued"]) == ("RUNNING", 1, 30, False)

    node = slurm.squeue([job])[0].nodelist
    high = _sbatch("-J", run_name + "-high", "-p", "high", "-w", node, "-N", "1", "-n", "1", "--exclusive",
                   "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 1")
    own_jobs.append(high)
    row = _wait_row(cli, run_name, lambda r: r["state"] == "PENDING" and r["reason"] == "BeginTime",
                    "PENDING (BeginTime) after preemption")
    assert (row["attempt"], row["requeued"], row["step"], row["group"]) == (2, True, 30, "queued")
    assert "requeued" in row["note"]

    rehearsal.start_now(job)
    row = _wait_row(cli, run_name, lambda r: r["state"] == "RUNNING", "RUNNING again")
    assert (row["attempt"], row["requeued"]) == (2, True)

    r = cli("cancel", run_name)
    assert r.code == 0 and f"scancel {job}" in r.out, r.out + r.err
    row = _wait_row(cli, run_name, lambda r: r["state"] == "CANCELLED", "CANCELLED")
    assert runs.load_record(run_name, lm_env).state == "cancelled"
