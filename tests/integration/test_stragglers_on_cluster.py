"""A slow rank on the real cluster: one rank of a 2-node tiny job slowed from outside (its process
stopped and continued in a duty cycle, as a throttled or shared node would run it) is named by
rank 0's straggler watch within a few scored intervals, with its node, in the ledger and in
`lmlaunch status --json`; the other rank is not; once the slowing stops the rank is no longer
slow. The same job unslowed flags nobody. Marked serial: ranks are compared with each other, so
these run while no other test loads the machine (scripts/test.sh's phase 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import waiting
from preempt_helpers import ledger, run_progress, wait_step
from slurm_helpers import REPO, SMALL_MODEL, DutyCycle

from lmcore import jsonlines
from lmcore.run.rank_logs import rank_text
from lmcore.run.task_records import read_task_records

pytestmark = pytest.mark.serial

WINDOW, MIN_INTERVAL_S = 3, 2.0
OVERRIDES = (
    "optim.warmup_steps=3",
    "trainer.val_check_interval=null",
    "trainer.log_every_n_steps=5",
    "checkpoint.every_n_steps=100000",
    "health.stragglers.threshold=1.5",
    f"health.stragglers.window={WINDOW}",
    f"health.stragglers.min_interval_s={MIN_INTERVAL_S}",
    *SMALL_MODEL,
)


def _submit(cli, lm_env, run_name, own_jobs, max_steps: int) -> tuple[str, Path]:
    r = cli("submit", str(REPO / "jobs" / "tiny-cpu.yaml"), f"name={run_name}", f"trainer.max_steps={max_steps}",
            *OVERRIDES)
    assert r.code == 0, r.out + r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    return job_id, Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name


def _stragglers(run_dir: Path) -> list[dict]:
    return [e for e in ledger(run_dir) if e.get("event") == "straggler"]


def test_a_rank_slowed_from_outside_is_named_with_its_node_and_the_other_is_not(slurm_cluster, cli, lm_env,
                                                                                 run_name, own_jobs):
    job_id, run_dir = _submit(cli, lm_env, run_name, own_jobs, max_steps=100000)
    wait_step(run_dir, 5, job_id=job_id)
    records, problems = read_task_records(run_dir, job_id, 0)
    assert not problems and [(t.rank, t.node) for t in records] == [(0, "n1"), (1, "n2")], records
    slow_pid = next(t.pid for t in records if t.rank == 1)

    def named() -> list[dict] | None:
        r = cli("status", "--json", run_name)
        rows = json.loads(r.out)["runs"] if r.code == 0 else []
        found = [s for row in rows for s in row.get("stragglers", [])]
        return found or None

    with DutyCycle(slow_pid):  # the text is read while the rank is still slowed: a window after, it is not
        found = waiting.until(named, progress=run_progress(run_dir, job_id), poll=1.0,
                              what=f"{run_name}: status names a slow rank", explain=lambda: str(ledger(run_dir)))
        r = cli("status", run_name)
    assert [(s["rank"], s["node"], s["against"]) for s in found] == [(1, "n2", "peers")], found
    assert found[0]["factor"] >= 1.5
    assert "slow: rank 1 (n2)" in r.out and "x the median compute" in r.out, r.out

    # the slowing stopped: no longer slow after a window of intervals at the others' pace
    waiting.until(lambda: any(e["state"] == "end" for e in _stragglers(run_dir)), progress=run_progress(run_dir, job_id),
                  poll=1.0, what=f"{run_name}: rank 1 no longer slow", explain=lambda: str(_stragglers(run_dir)))
    assert [(e["state"], e["rank"], e["node"]) for e in _stragglers(run_dir)] == [("start", 1, "n2"), ("end", 1, "n2")]
    log = rank_text(run_dir / "logs" / "attempt-1", 0)
    assert "straggler: rank 1 (n2)" in log and "straggler no longer: rank 1 (n2)" in log
    assert cli("cancel", run_name).code == 0


def test_the_same_job_unslowed_flags_nobody(slurm_cluster, cli, lm_env, run_name, own_jobs):
    """Watched long enough to score more than a window of intervals, however fast this host is (a fixed
    step count ran 800 steps in 11.7 s on a fast host, short of the 12 s it needs), then cancelled."""
    job_id, run_dir = _submit(cli, lm_env, run_name, own_jobs, max_steps=100000)
    timing = run_dir / "logs" / "attempt-1" / "timing-node-0.jsonl"  # rank 0's node's (lmtrain.observe.timing_lines)

    def scored() -> float | None:  # enough logging intervals for a window of scored ones, and then some
        lines = [t for t in jsonlines.read_jsonl(timing) if t.get("rank") == 0] if timing.exists() else []
        wall = sum(float(t.get("wall_s") or 0) for t in lines)
        return wall if wall >= 2 * WINDOW * MIN_INTERVAL_S else None

    waiting.until(scored, progress=run_progress(run_dir, job_id), poll=1.0, what=f"{run_name}: two windows scored")
    assert _stragglers(run_dir) == []
    assert cli("cancel", run_name).code == 0
