"""A hung rank on the real cluster: rank 1 of a 2-node job stops at step K while rank 0 waits in
the next gradient all-reduce. The hang watchdog must end every task within
hang_timeout_s + exit_grace_s, with the stacks of every rank in the run directory and `hang`
in the attempts ledger. (That the ranks then restart in place and the run completes, bit-identical:
the chaos campaign's stopped rank, met alone in every run, tests/integration/test_chaos.py.)"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import waiting
from slurm_helpers import REPO, faults, wait_accounted, wait_terminal

from lmcore.slurm import client as slurm

HANG_TIMEOUT_S = 12
GRACE_S = 8
HANG_STEP = 3
HANG = {"point": "watchdog.beat", "rank": 1, "step": HANG_STEP, "action": "hang"}
SLACK_S = 15  # SLURM noticing the task exits, step and job cleanup, our 1 s polling


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _submit_hanging(cli, lm_env, run_name, own_jobs, hang: dict, *overrides: str) -> tuple[str, Path]:
    """The tiny job with the hang fault, the watchdog at HANG_TIMEOUT_S + GRACE_S, a collective
    timeout far beyond it; (job id, run directory)."""
    with faults(hang):
        r = cli(
            "submit", str(REPO / "jobs" / "tiny-cpu.yaml"), f"name={run_name}", "optim.warmup_steps=2",
            "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
            f"watchdog.hang_timeout_s={HANG_TIMEOUT_S}", f"watchdog.exit_grace_s={GRACE_S}",
            "watchdog.collective_timeout_s=120", *overrides,
        )
    assert r.code == 0, r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    return job_id, Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name


def test_hung_rank_dumps_all_stacks_and_every_task_exits_within_timeout_plus_grace(
    slurm_cluster, cli, lm_env, run_name, own_jobs
):
    job_id, run_dir = _submit_hanging(cli, lm_env, run_name, own_jobs, HANG, "trainer.max_steps=40",
                                      "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=100",
                                      "preemption.max_crash_retries=0")

    state = wait_terminal(job_id)
    ended = time.time()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").rglob("*.log")))
    assert slurm.state_group(state) == "failed", f"job {job_id} ended {state}\n{logs}"

    # every rank's watchdog saw the hang at step K; everything ended within timeout + grace
    attempt = run_dir / "logs" / "attempt-1"
    reports = {r: json.loads((attempt / f"hang-rank-{r}.json").read_text()) for r in (0, 1)
               if (attempt / f"hang-rank-{r}.json").exists()}
    assert 1 in reports and reports[1]["step"] == HANG_STEP, reports
    last_progress = min(rep["time"] - rep["idle_s"] for rep in reports.values())
    assert ended - last_progress < HANG_TIMEOUT_S + GRACE_S + SLACK_S, (ended - last_progress, logs)
    acct = wait_accounted(job_id)  # sacct lags the controller under load (seen in CI: RUNNING 0:0)
    assert acct.exit_code.split(":")[0] in ("124", "1"), acct

    # stacks of every rank: the sleeping rank 1 in the test hook, rank 0 inside a collective
    for rank in (0, 1):
        text = (attempt / f"stacks-rank-{rank}.txt").read_text()
        assert "made no progress" in text or "a peer hung" in text, text[:500]
        assert "Thread 0x" in text and "lmtrain/task/entry.py" in text  # all threads, the main one included
    assert "in on_train_batch_end" in (attempt / "stacks-rank-1.txt").read_text()  # where rank 1 sleeps
    rank0 = (attempt / "stacks-rank-0.txt").read_text()
    assert "torch/distributed/" in rank0 or "a peer hung" in rank0, rank0[:3000]

    # the ledger says why, once
    ends = [e for e in _jsonl(run_dir / "attempts.jsonl") if e["event"] == "end"]
    assert len(ends) == 1, ends
    assert ends[0]["reason"] == "hang" and ends[0]["requeued"] is False, ends
    assert "no progress" in ends[0]["detail"] or "hang" in ends[0]["detail"].lower() or "peer" in ends[0]["detail"]
    assert not (run_dir / "DONE").exists()


def test_collective_timeout_from_the_spec_ends_the_waiting_rank_with_reason_hang(
    slurm_cluster, cli, lm_env, run_name, own_jobs
):
    # the process group's timeout (10 s) expires long before the watchdog (25 s) would fire
    with faults(HANG):  # rank 1 sleeps for good at the end of step HANG_STEP
        r = cli(
            "submit", str(REPO / "jobs" / "tiny-cpu.yaml"), f"name={run_name}",
            "trainer.max_steps=40", "optim.warmup_steps=2", "trainer.val_check_interval=null",
            "trainer.limit_val_batches=0", "checkpoint.every_n_steps=100",
            "watchdog.collective_timeout_s=10", "watchdog.hang_timeout_s=25", f"watchdog.exit_grace_s={GRACE_S}",
            "preemption.max_crash_retries=0",
        )
    assert r.code == 0, r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name

    ledger = run_dir / "attempts.jsonl"
    waiting.until(lambda: [e for e in _jsonl(ledger) if e["event"] == "end"], poll=1.0,
                  progress=waiting.watching(waiting.tree(run_dir), waiting.job(job_id)),
                  what="the ledger's end line", explain=lambda: f"{_jsonl(ledger)}")
    end = [e for e in _jsonl(ledger) if e["event"] == "end"][0]
    start = [e for e in _jsonl(ledger) if e["event"] == "start"][0]
    # rank 0 gave up inside the collective after the spec's 10 s, not after the watchdog's 25 s
    assert end["reason"] == "hang", end
    assert "timeout" in end["detail"].lower() or "timed out" in end["detail"].lower(), end["detail"]
    assert not (run_dir / "logs" / "attempt-1" / "hang-rank-0.json").exists()
    assert end["time"] > start["time"], (start, end)
    # rank 1 (asleep) is then ended by its own watchdog: the whole job ends
    state = wait_terminal(job_id)
    assert slurm.state_group(state) == "failed", state
    hung = json.loads((run_dir / "logs" / "attempt-1" / "hang-rank-1.json").read_text())
    assert hung["step"] == HANG_STEP
    # measured from the hang (rank 1's last progress), not from the attempt's start, whose model
    # setup takes longer on a loaded machine: rank 0 ended ~10 s later, well before 25 s
    hang_began = hung["time"] - hung["idle_s"]
    assert end["time"] - hang_began < 25, (hang_began, end)
