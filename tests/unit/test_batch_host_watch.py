"""The run's watcher and a lost batch node (launcher.submit.batch_host_watch): it takes a job for
lost only as the keeper does (running on without its batch script's node, or ended for it), and acts
only once the loss has outlasted the keeper's chance to act first. On the real cluster:
tests/integration/chaos_found/keeper-killed-then-batch-host-down.json (test_chaos.py)."""

from __future__ import annotations

import json

from launcher.runs.registry import RunRecord
from launcher.submit.batch_host_watch import GRACE_S, BatchHostWatch, seen_lost

RUNNING = {"JobState": "RUNNING", "BatchHost": "n1", "NodeList": "n[1-3]", "Reason": "None"}


def _record(tmp_path, max_steps=80) -> RunRecord:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "plan.json").write_text(json.dumps({"trainer": {"max_steps": max_steps}}))
    return RunRecord(name="r", profile="local", run_dir=str(run), spec_path=None, job_ids=["7"])


def test_a_job_is_lost_as_the_keeper_would_take_it(tmp_path):
    rec = _record(tmp_path)
    assert seen_lost({**RUNNING, "NodeList": "n[2-3]"}, "IDLE", rec)  # taken out of the job, back in service
    assert seen_lost(RUNNING, "DOWN+DRAIN", rec)
    assert not seen_lost(RUNNING, "MIXED+NOT_RESPONDING", rec)  # a node slow to answer under load
    assert not seen_lost(RUNNING, "ALLOCATED", rec)
    failed = {**RUNNING, "JobState": "FAILED", "Reason": "JobLaunchFailure"}  # 22.05's end of such a job
    assert seen_lost(failed, "IDLE+DRAIN", rec)
    assert not seen_lost({**failed, "Reason": "NonZeroExitCode"}, "IDLE", rec)  # the training failed
    for state in ("PENDING", "COMPLETED", "CANCELLED", "PREEMPTED", "TIMEOUT"):
        assert not seen_lost({**failed, "JobState": state}, "DOWN", rec), state
    assert not seen_lost(None, "DOWN", rec)  # SLURM did not answer: never guessed
    (tmp_path / "run" / "DONE").write_text("80\n")
    assert not seen_lost(failed, "DOWN", rec)  # the run is done: nothing to requeue


def test_it_acts_only_after_the_keeper_had_its_chance_and_once_per_loss():
    w = BatchHostWatch()
    assert w.decide(False, 0.0) is None
    assert w.decide(True, 100.0) == "seen"
    assert w.decide(True, 100.0 + GRACE_S - 1) == "wait"
    assert w.decide(True, 100.0 + GRACE_S) == "act"
    assert w.decide(True, 100.0 + GRACE_S + 15) == "seen"  # still lost at the next look: a new grace first
    assert w.decide(False, 200.0) is None  # the keeper requeued it, or it was never lost for long
    assert w.decide(True, 300.0) == "seen"


def test_status_tells_a_spare_run_whose_watcher_is_not_running(tmp_path):
    """The watcher holds RUN/mover.lock while it runs; `status` asks (one flock, never kept) and says
    when it is gone (a login node's restart ends it), with the command that starts it again."""
    import subprocess
    import sys

    from waiting import HANG_S

    from launcher.runs.run_lock import watcher_alive
    from lmcore.run.run_layout import RunLayout

    run = tmp_path / "run"
    run.mkdir()
    assert not watcher_alive(run)  # never started
    lock = RunLayout.of(run).mover_lock
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(lock)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert watcher_alive(run)
    finally:
        holder.communicate("", timeout=HANG_S)
    assert not watcher_alive(run)  # its lock went with its process
