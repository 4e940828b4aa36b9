"""The job's keeper (lmtrain.task.keeper): it requeues a job with spare nodes only when SLURM ended it
for its batch script's node, and otherwise does nothing; as a process it sleeps through SLURM's
warning signals, wakes on SIGTERM, and writes to a log file of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import waiting
from waiting import HANG_S

from lmcore.run.lost_batch_host import failed_state, lost_while_running, what_ended, why_not

REPO = Path(__file__).resolve().parents[2]
LOST = {"JobState": "COMPLETING", "Reason": "JobLaunchFailure", "BatchHost": "n1"}


@pytest.mark.parametrize("state, failed", [
    ("DOWN", True), ("DOWN+DRAIN", True), ("DOWN+NOT_RESPONDING", True), ("IDLE+FAIL", True),
    ("MIXED+DRAIN+NOT_RESPONDING", True), ("IDLE+DRAIN", False), ("ALLOCATED", False), ("", False),
])
def test_a_failed_node_is_told_from_a_drained_one(state, failed):
    assert failed_state(state) is failed


def test_it_requeues_only_a_job_that_lost_its_batch_node_in_a_run_with_work_left(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"trainer": {"max_steps": 80}}))
    assert why_not(LOST, "IDLE+DRAIN", run) is None  # SLURM's reason says it (the node may be back already)
    assert why_not({**LOST, "Reason": "None"}, "DOWN+NOT_RESPONDING", run) is None  # the node's state says it
    assert "is up (IDLE)" in why_not({**LOST, "Reason": "None"}, "IDLE", run)  # a job ending for any other reason
    assert "is up" in why_not({**LOST, "Reason": "None"}, "IDLE+DRAIN", run)  # drained for maintenance: not failed
    for state in ("PENDING", "CANCELLED", "COMPLETED", "PREEMPTED", "TIMEOUT"):
        assert why_not({**LOST, "JobState": state}, "DOWN", run) == f"the job is {state}"
    assert why_not(None, "DOWN", run) == "SLURM does not answer about the job"
    (run / "DONE").write_text("40\n")  # DONE below max_steps: a run continued to more steps trains on
    assert why_not(LOST, "DOWN", run) is None
    (run / "DONE").write_text("80\n")
    assert why_not(LOST, "DOWN", run) == "the run is done"
    (run / "DONE").unlink()
    (run / "CANCELLED").touch()
    assert why_not(LOST, "DOWN", run) == "the run is cancelled"


def test_the_end_line_tells_a_failed_batch_node_from_a_killed_batch_script():
    """SLURM says JobLaunchFailure, ExitCode 0:9, both when the batch script's node fails and when the
    script alone is SIGKILLed (a chaos campaign's batch_kill was recorded as a node failure): the
    node's state when the keeper looks tells them apart."""
    lost = {**LOST, "ExitCode": "0:9"}
    for state in ("DOWN+DRAIN", "IDLE+DRAIN", "DOWN+NOT_RESPONDING"):
        reason, detail = what_ended(lost, state)
        assert reason == "node_failure" and detail.startswith("node n1 of the batch script and rank 0 failed"), state
    reason, detail = what_ended(lost, "IDLE+COMPLETING")
    assert reason == "crashed", detail
    assert "the batch script on n1 ended (SLURM: JobLaunchFailure, ExitCode 0:9: killed by signal 9) while its " \
           "node stayed up (IDLE+COMPLETING)" == detail
    assert what_ended({**LOST, "ExitCode": "1:0"}, "IDLE")[1].endswith("ExitCode 1:0) while its node stayed up (IDLE)")


def test_a_batch_script_sigkilled_on_a_node_that_stays_up_is_requeued_as_a_crash(tmp_path):
    """26.05 ends such a job FAILED, Reason RaisedSignal:9(Killed), ExitCode 0:9 (22.05 says
    JobLaunchFailure): the keeper and the watcher requeue it when rank 0 could not (a chaos
    campaign's batch_kill on 26.05 lost its run)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"trainer": {"max_steps": 80}}))
    killed = {**LOST, "JobState": "FAILED", "Reason": "RaisedSignal:9(Killed)", "ExitCode": "0:9"}
    assert why_not(killed, "MIXED", run) is None
    assert what_ended(killed, "MIXED")[0] == "crashed"
    assert "is up (MIXED)" in why_not({**killed, "ExitCode": "0:15"}, "MIXED", run)  # SIGTERM: a cancel, a limit


def test_a_running_job_whose_batch_node_is_down_is_lost_without_a_signal():
    """SLURM 26.05 keeps a --no-kill job RUNNING on its other nodes when the batch script's node
    fails, and signals nobody: the keeper's own look finds it. A node that only does not answer for
    a moment (under load) is not lost."""
    running = {"JobState": "RUNNING", "BatchHost": "n1", "NodeList": "n[1-3]"}
    for state in ("DOWN", "DOWN+DRAIN", "DOWN+NOT_RESPONDING", "IDLE+FAIL", "MIXED+FAILING"):
        assert lost_while_running(running, state), state
    for state in ("MIXED+NOT_RESPONDING", "ALLOCATED", "MIXED+DRAIN", ""):
        assert not lost_while_running(running, state), state
    # SLURM removed the failed node from the job and, a second later, returned it to service
    # (ReturnToService=2): the node is IDLE again, but the job runs on without it
    assert lost_while_running({**running, "NodeList": "n[2-3]"}, "IDLE")
    assert what_ended({**running, "NodeList": "n[2-3]"}, "IDLE")[0] == "node_failure"
    assert not lost_while_running({**running, "NodeList": "(null)"}, "IDLE")  # SLURM does not say
    assert not lost_while_running({**running, "JobState": "COMPLETING"}, "DOWN")  # SLURM's SIGTERM then


def test_the_process_sleeps_through_warning_signals_and_wakes_on_sigterm(tmp_path):
    log = tmp_path / "keeper.log"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "SLURM_JOB_ID": "999999999", "SLURMD_NODENAME": "n2",
           "SLURM_CONF": str(tmp_path / "no-such-slurm.conf")}  # SLURM does not answer: nothing to do
    proc = subprocess.Popen([sys.executable, "-m", "lmtrain.task.keeper", str(tmp_path), str(log)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    waiting_for = "keeping job 999999999 on n2"
    waiting.until(lambda: log.exists() and waiting_for in log.read_text(), progress=waiting.file_grows(log),
                  what="the keeper's first line")
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):
        proc.send_signal(sig)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0 and not out and not err, (out, err)  # nothing through the step's I/O
    assert "nothing to do" in log.read_text(), log.read_text()
