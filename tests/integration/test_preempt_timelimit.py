"""A time limit shorter than the run. With resources.time = 2 min and
the warning signal 60 s before it, a run that needs longer checkpoints at the warning, requeues
itself and is resumed until it is done; with preemption.max_timeouts = 0 it stops at the first
time limit, not requeued, and the ledger says why.

Both runs are submitted together (each takes one CPU of each node; their steps are slowed by a
test-only sleep, so they hardly use the CPU) to keep the test at one pair of time limits.
"""

from __future__ import annotations

import pytest
from preempt_helpers import ends, finish, held_at, log_tail, starts, submit, wait_ended
from slurm_helpers import faults, wait_accounted

from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs these on the other SLURM version too
TIME_LIMIT = ("resources.time=00:02:00", "preemption.warning_seconds=60")
SLOW = {"point": "train.batch_end", "action": "sleep", "seconds": 0.8}  # slow steps without burning CPU
STEPS = "trainer.max_steps=70"  # ~70 s of steps: more than one attempt gets before its warning


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("timelimit")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMLAUNCH_HOME", str(root / "home"))
        mp.setenv("LMLAUNCH_RUNS_ROOT", str(root / "runs"))
        env = dict(os.environ)
        # the first attempts held at step 68 until the warning signal (it opens the gate): however fast
        # the host, neither can finish its 70 steps before its first time limit
        with faults(SLOW, held_at(68)):
            requeue = submit(env, "tl-requeues", STEPS, *TIME_LIMIT, pace_s=None)  # SLOW paces them
            capped = submit(env, "tl-capped", STEPS, *TIME_LIMIT, "preemption.max_timeouts=0", pace_s=None)
        try:
            yield {"requeues": requeue, "capped": capped}
        finally:
            for job, _ in (requeue, capped):
                if slurm.is_active(slurm.job_state(job)):
                    slurm.cancel([job])


def test_time_limit_shorter_than_run_requeues_until_done(runs):
    job, run_dir = runs["requeues"]
    finish(job, run_dir)
    reasons = [e["reason"] for e in ends(run_dir)]
    assert reasons[-1] == "completed" and len(reasons) >= 2, reasons
    assert set(reasons[:-1]) == {"timeout"}, ends(run_dir)
    for prev, nxt in zip(ends(run_dir), starts(run_dir)[1:]):
        assert prev["requeued"] is True and nxt["start_step"] == prev["end_step"] > 0, (prev, nxt)
    assert (run_dir / "DONE").exists()
    assert slurm.restart_count(job) == len(reasons) - 1


def test_time_limit_stops_at_max_timeouts_with_the_reason(runs):
    job, run_dir = runs["capped"]
    state = wait_ended(job)
    end = ends(run_dir)
    assert len(starts(run_dir)) == 1 and len(end) == 1, (end, log_tail(run_dir))
    assert end[0]["reason"] == "limit_reached" and end[0]["requeued"] is False, end
    assert "max_timeouts(0)" in end[0]["detail"], end
    assert 0 < end[0]["end_step"] < 70 and not (run_dir / "DONE").exists()
    assert slurm.restart_count(job) == 0 and slurm.state_group(state) != "queued"
    wait_accounted(job)
