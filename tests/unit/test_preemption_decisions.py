"""Why an attempt ended and whether the job runs again (lmtrain.preemption.decide / start_gate),
the signal handlers (record only, the training process only, restored afterwards), and the start
gate through the real entry (finished, cancelled and stuck runs exit without training)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lmcore.job.plan import PreemptionPlan
from lmcore.job.spec import PreemptionSpec
from lmcore.run.rank_logs import rank_text
from lmcore.run.rundir import LedgerAttempt as AttemptRow
from lmtrain.preemption.policy import EndFacts, StartFacts, decide, start_gate, steps_without_progress
from lmtrain.preemption.signals import SignalOwner, StopRequest, guard_dataloader_workers

POLICY = PreemptionPlan.of(PreemptionSpec(signal="USR2", warning_seconds=120, max_requeues=5, max_timeouts=2,
                                          max_crash_retries=1, no_progress_attempts=3))


def _facts(**kw) -> EndFacts:
    base = dict(end_step=40, start_step=20, max_steps=100, checkpoint_step=40, stopped=True, crashed=False,
                launcher="slurm", job_id="12", slurm_state="RUNNING")
    return EndFacts(**{**base, **kw})


# --------------------------------------------------------------------------- decide
def test_warning_signal_near_the_time_limit_is_a_timeout_and_the_job_requeues_itself():
    d = decide(_facts(warning=True, seconds_left=150.0), POLICY)
    assert (d.reason, d.requeued, d.action, d.exit_code) == ("timeout", True, "requeue", 0)
    assert "SIGUSR2 150 s before the time limit" in d.detail and "checkpoint step-40 complete" in d.detail


def test_sigterm_of_a_preemption_is_not_requeued_twice():
    for state in ("PREEMPTED", "REQUEUED", "PENDING"):
        d = decide(_facts(term=True, seconds_left=900.0, slurm_state=state), POLICY)
        assert (d.reason, d.requeued, d.action) == ("preempted", True, None), state
        assert "requeued by SLURM" in d.detail


def test_sigterm_in_the_grace_time_of_a_preemption_requeues_itself():
    # the job still shows RUNNING during GraceTime, with a PreemptTime; slurm 22.05 ends a
    # preempted job whose tasks exit in time as COMPLETED (never requeued): requeue it ourselves
    d = decide(_facts(term=True, seconds_left=900.0, slurm_state="RUNNING", preempting=True), POLICY)
    assert (d.reason, d.requeued, d.action) == ("preempted", True, "requeue")
    assert "PreemptTime set" in d.detail
    # or SLURM already counted the requeue
    d = decide(_facts(term=True, seconds_left=900.0, slurm_state="RUNNING", restart_count=1, slurm_restarts=2), POLICY)
    assert (d.reason, d.requeued, d.action) == ("preempted", True, None)


def test_sigterm_while_slurm_still_runs_the_job_requeues_it():
    d = decide(_facts(term=True, seconds_left=900.0, slurm_state="RUNNING"), POLICY)
    assert (d.reason, d.requeued, d.action) == ("preempted", True, "requeue")


def test_user_signal_on_preemption_far_from_the_limit_is_a_preemption():
    policy = dataclasses.replace(POLICY, cluster_sends_user_signal=True)
    d = decide(_facts(warning=True, seconds_left=3000.0, slurm_state="PREEMPTED"), policy)
    assert (d.reason, d.action) == ("preempted", None)
    d = decide(_facts(warning=True, term=True, seconds_left=3000.0, slurm_state="PREEMPTED"), policy)
    assert d.reason == "preempted"
    # the same signal near the limit is the time-limit warning
    assert decide(_facts(warning=True, seconds_left=100.0), policy).reason == "timeout"


def test_cancel_is_never_requeued():
    d = decide(_facts(term=True, cancelled_marker=True), POLICY)
    assert (d.reason, d.requeued, d.action) == ("cancelled", False, None)
    assert "CANCELLED marker" in d.detail
    d = decide(_facts(term=True, slurm_state="CANCELLED by 0"), POLICY)
    assert (d.reason, d.requeued, d.action) == ("cancelled", False, None)


def test_a_job_slurm_is_ending_for_an_unknown_reason_is_not_requeued():
    # a bare scancel shows JobState=COMPLETING while the tasks run; with accounting it reads
    # CANCELLED (-> cancelled, above); without it, a requeue could undo the user's cancel
    d = decide(_facts(term=True, seconds_left=900.0, slurm_state="COMPLETING"), POLICY)
    assert (d.reason, d.requeued, d.action) == ("preempted", False, None)
    assert "COMPLETING" in d.detail
    d = decide(_facts(term=True, seconds_left=900.0, slurm_state="CANCELLED by 0"), POLICY)
    assert (d.reason, d.requeued, d.action) == ("cancelled", False, None)


def test_a_job_slurm_ended_because_its_batch_script_was_sigkilled_is_a_crash_requeued_not_restarted():
    """26.05 ends a job whose batch script was SIGKILLed (its node up) FAILED, RaisedSignal:9, and
    SIGTERMs the ranks: not a preemption, not a user's cancel (a chaos campaign's batch_kill on 26.05
    ended the run FAILED, "a bare scancel?"). A crash, requeued by rank 0 (no batch script is left to
    restart the ranks in place), within max_crash_retries; a cancel stays a cancel."""
    from lmcore.run.lost_batch_host import batch_killed

    info = {"JobState": "COMPLETING", "Reason": "RaisedSignal:9(Killed)", "ExitCode": "0:9"}
    killed = batch_killed(info)
    assert killed == "SIGKILL; SLURM: RaisedSignal:9(Killed), ExitCode 0:9"
    assert batch_killed({**info, "JobState": "FAILED"}) == killed
    assert batch_killed({**info, "ExitCode": "0:15"}) is None and batch_killed({**info, "JobState": "CANCELLED"}) is None
    assert batch_killed({**info, "ExitCode": "9:0"}) is None  # exit status 9, no signal
    d = decide(_facts(term=True, seconds_left=900.0, slurm_state="COMPLETING", batch_killed=killed), POLICY)
    assert (d.reason, d.requeued, d.action) == ("crashed", True, "requeue"), d
    assert d.detail.startswith("the job's batch script was killed (SIGKILL; SLURM: RaisedSignal:9(Killed)"), d.detail
    spent = [AttemptRow(1, "12", 0, 20, "crashed", True)]  # max_crash_retries(1) spent
    d = decide(_facts(term=True, slurm_state="FAILED", batch_killed=killed, history=spent), POLICY)
    assert (d.reason, d.requeued) == ("crashed", False) and "max_crash_retries" in d.detail, d
    d = decide(_facts(term=True, slurm_state="COMPLETING", batch_killed=killed, cancelled_marker=True), POLICY)
    assert (d.reason, d.requeued) == ("cancelled", False)


def test_a_finished_run_is_never_requeued_even_when_signalled():
    d = decide(_facts(end_step=100, checkpoint_step=100, warning=True, seconds_left=60.0), POLICY)
    assert (d.reason, d.requeued, d.action) == ("completed", False, None)


REQUEUE_ONLY = dataclasses.replace(POLICY, restart_in_place=False)


def test_crash_requeues_at_most_max_crash_retries_times():
    d = decide(_facts(stopped=False, crashed=True, error="RuntimeError: boom"), REQUEUE_ONLY)
    assert (d.reason, d.requeued, d.action, d.exit_code) == ("crashed", True, "requeue", 1)
    history = [AttemptRow(1, "12", 0, 20, "crashed", True)]
    d = decide(_facts(stopped=False, crashed=True, error="RuntimeError: boom", history=history), POLICY)
    assert (d.reason, d.requeued, d.action, d.exit_code) == ("crashed", False, None, 1)
    assert "max_crash_retries(1) reached" in d.detail and "RuntimeError: boom" in d.detail


@pytest.mark.parametrize("kw, action, words", [
    ({}, "restart", "restarted in place (the same job and nodes, no queue wait)"),
    ({"reason_hang": True}, "restart", "restarted in place"),
    ({"seconds_left": 200.0}, "requeue", "not restarted in place: 200 s left in the allocation, under the 240 s"),
    ({"seconds_left": 3600.0}, "restart", "restarted in place"),
    ({"first_death_node": "n2", "previous_first_death_node": "n2"}, "requeue",
     "died on n2 in the attempt before too: the node is suspect"),
    ({"first_death_node": "n2", "previous_first_death_node": "n1"}, "restart", "restarted in place"),
    ({"slurm_state": "PENDING"}, None, "requeued by SLURM"),
    ({"policy": REQUEUE_ONLY}, "requeue", "requeued (scontrol requeue"),
    ({"launcher": "local"}, None, "local run: not requeued"),
])
def test_a_crash_or_a_hang_restarts_in_place_unless_time_the_node_or_slurm_says_otherwise(kw, action, words):
    kw = dict(kw)
    policy = kw.pop("policy", POLICY)
    hang = kw.pop("reason_hang", False)
    facts = _facts(stopped=False, crashed=True, error="RuntimeError: Connection closed by peer", **kw)
    d = decide(facts, policy)
    if hang:  # the watchdog's: the controller settles a hang as a crash, then names it
        assert d.reason == "crashed"
    assert d.action == action and words in d.detail, d
    assert d.requeued is (kw.get("launcher") != "local")


def test_restarts_in_place_count_as_crash_retries_and_a_crash_loop_stops():
    history = [AttemptRow(1, "12", 0, 40, "crashed", True), AttemptRow(2, "12", 40, 40, "crashed", True),
               AttemptRow(3, "12", 40, 40, "crashed", True)]
    d = decide(_facts(stopped=False, crashed=True, error="boom", history=history[:1]), POLICY)
    assert "max_crash_retries(1) reached" in d.detail and d.action is None  # the retry budget is one, in place or not
    many = dataclasses.replace(POLICY, max_crash_retries=10)
    d = decide(_facts(stopped=False, crashed=True, error="boom", start_step=40, end_step=40, checkpoint_step=40,
                      history=history), many)
    assert d.reason == "no_progress" and d.action is None, d  # restarted in place, never past step 40


def test_max_requeues_stops_the_job_and_cancels_a_requeue_slurm_started():
    d = decide(_facts(term=True, seconds_left=900.0, restart_count=5), POLICY)
    assert (d.reason, d.requeued, d.action) == ("limit_reached", False, None)
    assert "max_requeues(5) reached" in d.detail
    d = decide(_facts(term=True, seconds_left=900.0, restart_count=5, slurm_state="PREEMPTED"), POLICY)
    assert (d.reason, d.requeued, d.action) == ("limit_reached", False, "cancel")


def test_max_timeouts_stops_the_job_with_the_reason():
    history = [AttemptRow(1, "12", 0, 10, "timeout", True), AttemptRow(2, "12", 10, 20, "timeout", True)]
    d = decide(_facts(warning=True, seconds_left=100.0, history=history, restart_count=2), POLICY)
    assert (d.reason, d.requeued, d.action) == ("limit_reached", False, None)
    assert "max_timeouts(2) reached (3 time limits)" in d.detail and d.detail.startswith("timeout:")


def test_no_progress_over_k_attempts_stops_the_job():
    history = [AttemptRow(1, "12", 20, 20, "preempted", True), AttemptRow(2, "12", 20, 20, "preempted", True)]
    d = decide(_facts(term=True, seconds_left=900.0, end_step=20, checkpoint_step=20, history=history), POLICY)
    assert (d.reason, d.requeued) == ("no_progress", False)
    assert "stayed at 20 over 3 attempts" in d.detail
    # one attempt that moved the step resets the count
    history[0] = AttemptRow(1, "12", 10, 20, "preempted", True)
    assert steps_without_progress([10, 20], 20) == 1
    assert steps_without_progress([20, 20], 20) == 2
    d = decide(_facts(term=True, seconds_left=900.0, end_step=21, checkpoint_step=21, history=history), POLICY)
    assert d.reason == "preempted"


def test_local_runs_are_never_requeued():
    d = decide(_facts(term=True, launcher="local", slurm_state=None), POLICY)
    assert (d.reason, d.requeued, d.action) == ("preempted", False, None)
    d = decide(_facts(warning=True, launcher="local", slurm_state=None), POLICY)
    assert d.reason == "timeout"  # no time limit known, the cluster does not send it on preemption


# --------------------------------------------------------------------------- start gate
def _start(**kw) -> StartFacts:
    base = dict(done_marker=False, cancelled_marker=False, start_step=30, restart_count=1, job_id="12", history=[])
    return StartFacts(**{**base, **kw})


def _missing_end_written(tmp_path, gate, *, attempt: int) -> dict:
    """The end line AttemptRecords writes for the gate's missing end (rank 0 of ``attempt``)."""
    from types import SimpleNamespace

    from lmcore.jsonlines import read_jsonl
    from lmtrain.observe.attempt import AttemptRecords, MissingEnd

    paths = SimpleNamespace(run_dir=str(tmp_path), logs_dir=str(tmp_path / "logs"), checkpoint_dir=str(tmp_path),
                            ledger=str(tmp_path / "attempts.jsonl"), heartbeat=str(tmp_path / "hb.jsonl"))
    env = SimpleNamespace(rank=0, job_id="12", world_size=1)
    AttemptRecords(SimpleNamespace(paths=paths), env, attempt).missing_end(MissingEnd(**gate.previous_end))
    [end] = read_jsonl(paths.ledger)
    return end


def test_attempt_without_end_line_is_recorded_as_node_failure_at_the_next_start(tmp_path):
    history = [AttemptRow(1, "12", 0, 20, "preempted", True), AttemptRow(2, "12", 20)]
    gate = start_gate(_start(history=history), POLICY)
    assert not gate.exit
    # the attempt's records write the end line the gate found missing (lmtrain.preemption.gate)
    end = _missing_end_written(tmp_path, gate, attempt=3)
    assert (end["event"], end["attempt"], end["reason"], end["end_step"], end["requeued"]) == (
        "end", 2, "node_failure", 30, True)
    # accounting may know better
    gate = start_gate(_start(history=[AttemptRow(1, "12", 0)], previous_state="PREEMPTED"), POLICY)
    assert gate.previous_end["reason"] == "preempted" and "SLURM: PREEMPTED" in gate.previous_end["detail"]
    # SLURM requeued it (a preemption or `scontrol requeue` while a killed rank 0 was being restarted:
    # the chaos campaign's schedule of seed 1): taken back by SLURM, not a node failure
    gate = start_gate(_start(history=[AttemptRow(1, "12", 0)], previous_state="REQUEUED"), POLICY)
    assert gate.previous_end["reason"] == "preempted" and "(SLURM: REQUEUED)" in gate.previous_end["detail"]
    assert "node failure" not in gate.previous_end["detail"]


def test_an_attempt_whose_rank_zero_died_before_deciding_is_a_crash_restarted_in_place(tmp_path):
    """The batch script restarted the ranks after srun failed with no decision from rank 0
    (launcher.submit.in_place sets the variable the gate reads): the missing end is a crash, in place."""
    gate = start_gate(_start(history=[AttemptRow(1, "12", 0)], restart_count=0, undecided_exit="137"), POLICY)
    assert not gate.exit
    end = _missing_end_written(tmp_path, gate, attempt=2)
    assert (end["reason"], end["restart"], end["requeued"], end["end_step"]) == ("crashed", "in_place", True, 30)
    assert "rank 0's process ended before it decided (srun exited 137" in end["detail"], end


def test_start_gate_refuses_finished_cancelled_and_stuck_runs():
    assert start_gate(_start(done_marker=True), POLICY).reason == "completed"
    assert start_gate(_start(cancelled_marker=True), POLICY).reason == "cancelled"
    gate = start_gate(_start(restart_count=6), POLICY)
    assert (gate.exit, gate.reason) == (True, "limit_reached") and "max_requeues(5)" in gate.detail
    stuck = [AttemptRow(i, "12", 30, 30, "preempted", True) for i in (1, 2, 3)]
    gate = start_gate(_start(history=stuck), POLICY)
    assert (gate.exit, gate.reason) == (True, "no_progress")
    assert not start_gate(_start(history=stuck[:2]), POLICY).exit


def test_a_finished_run_continued_to_a_larger_max_steps_trains_on():
    assert start_gate(_start(done_marker=True, done_step=30, max_steps=30), POLICY).reason == "completed"
    assert start_gate(_start(done_marker=True, done_step=30, max_steps=20), POLICY).reason == "completed"
    assert start_gate(_start(done_marker=True, done_step=None, max_steps=60), POLICY).reason == "completed"
    gate = start_gate(_start(done_marker=True, done_step=30, max_steps=60), POLICY)
    assert not gate.exit


# --------------------------------------------------------------------------- handlers
def test_handlers_only_record_and_are_restored():
    before_term, before_usr2 = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)
    stop = StopRequest()
    owner = SignalOwner(stop, "USR2")
    owner.install()
    owner.install()  # again, as after Lightning's registration: the first originals are kept
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)
        assert stop.requested and stop.reason == "timeout" and owner.record.warning_at is not None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert owner.record.term_at is not None and owner.record.count == 2
        assert stop.reason == "timeout"  # the first request's reason is kept; the decision comes later
    finally:
        owner.restore()
    assert signal.getsignal(signal.SIGTERM) is before_term and signal.getsignal(signal.SIGUSR2) is before_usr2


class _SignalsItself(torch.utils.data.Dataset):
    """A DataLoader worker that receives the signals itself (as with scancel, every process of
    the task gets them) and reports what its copy of the handler state saw."""

    def __init__(self, stop: StopRequest) -> None:
        self.stop = stop

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        return torch.tensor([os.getpid(), int(self.stop.requested)])


def test_handlers_are_inert_in_dataloader_workers():
    stop = StopRequest()
    owner = SignalOwner(stop, "USR2")
    owner.install()
    try:
        loader = torch.utils.data.DataLoader(_SignalsItself(stop), num_workers=1, batch_size=None,
                                             multiprocessing_context="fork")
        guard_dataloader_workers([loader], owner.signums, rank=0)  # what the entry does to its loaders
        # an unguarded worker dies of SIGTERM (torch's own handler): "worker exited unexpectedly"
        got = [t.tolist() for t in loader]
    finally:
        owner.restore()
    assert len(got) == 2
    assert all(pid != os.getpid() and requested == 0 for pid, requested in got)
    assert not stop.requested and owner.record.count == 0  # the training process saw nothing


# --------------------------------------------------------------------------- the gate through the entry
@pytest.fixture
def local_run(repo, runs_root, monkeypatch):
    """A 1-process local run directory, and this process set up as its rank 0."""
    from launcher.submit.local_run import prepare_local_run

    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), ["model.config.n_layer=1"], devices=1,
                             max_steps=10, name="gate", environ=dict(os.environ), say=lambda *_: None)
    for k, v in {"LMTRAIN_LAUNCHER": "local", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "LMTRAIN_JOB_ID": f"local-test-{time.time()}"}.items():
        monkeypatch.setenv(k, v)
    return plan


def _ledger(plan) -> list[dict]:
    return [json.loads(x) for x in Path(plan.paths.ledger).read_text().splitlines()]


def test_a_requeued_finished_run_exits_at_once_without_training(local_run):
    from lmtrain.task.entry import run_task

    Path(local_run.paths.run_dir, "DONE").write_text("10\n")
    assert run_task(local_run.paths.run_dir) == 0
    start, end = _ledger(local_run)
    assert start["event"] == "start" and start["attempt"] == 1
    assert (end["event"], end["reason"], end["requeued"], end["skipped"]) == ("end", "completed", False, True)
    assert not Path(local_run.paths.checkpoint_dir).exists() or not any(Path(local_run.paths.checkpoint_dir).iterdir())


def test_a_cancelled_run_exits_at_once_and_records_the_missing_end_of_the_killed_attempt(local_run):
    from lmtrain.task.entry import run_task

    ledger = Path(local_run.paths.ledger)
    ledger.write_text(json.dumps({"event": "start", "attempt": 1, "job_id": "7", "start_step": 0}) + "\n")
    Path(local_run.paths.run_dir, "CANCELLED").write_text("")
    assert run_task(local_run.paths.run_dir) == 0
    lines = _ledger(local_run)
    assert [(e["event"], e["attempt"], e.get("reason")) for e in lines] == [
        ("start", 1, None), ("end", 1, "node_failure"), ("start", 2, None), ("end", 2, "cancelled")]


def test_a_run_that_made_no_progress_over_k_attempts_is_stopped(local_run):
    from lmtrain.task.entry import run_task

    lines = []
    for n in (1, 2, 3):
        lines += [{"event": "start", "attempt": n, "job_id": "7", "start_step": 0},
                  {"event": "end", "attempt": n, "job_id": "7", "end_step": 0, "reason": "crashed", "requeued": True}]
    Path(local_run.paths.ledger).write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert run_task(local_run.paths.run_dir) == 0
    end = _ledger(local_run)[-1]
    assert (end["attempt"], end["reason"]) == (4, "no_progress") and "no_progress_attempts=3" in end["detail"]


def _fake_zero_checkpoint(plan) -> None:
    step = Path(plan.paths.checkpoint_dir) / "step-4"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"format": 1, "step": 4, "world_size": 2, "strategy": "deepspeed",
                                                "zero_stage": 2}))
    (step / "COMPLETE").write_text("4\n")


def test_another_strategys_checkpoint_that_cannot_be_converted_fails_and_says_why(local_run):
    """A ZeRO checkpoint resumed by DDP is read through its universal form (lmtrain.checkpoint.cross_format);
    this one has no DeepSpeed files, so rank 0's conversion fails and the attempt ends, not requeued,
    with the reason and the ways that work."""
    from lmtrain.task.entry import run_task

    _fake_zero_checkpoint(local_run)
    before = signal.getsignal(signal.SIGTERM)
    assert run_task(local_run.paths.run_dir) == 2
    end = _ledger(local_run)[-1]
    assert (end["reason"], end["requeued"]) == ("crashed", False)
    assert "ZeRO-2 on 2 ranks and this attempt runs ddp on 1" in end["detail"]
    assert "converting it failed (FileNotFoundError" in end["detail"] and "Resume with ZeRO on 2 ranks" in end["detail"]
    log_text = rank_text(Path(local_run.paths.logs_dir, "attempt-1"), 0)
    assert "cannot resume" in log_text and "lmlaunch export" in log_text
    assert signal.getsignal(signal.SIGTERM) is before  # handlers given back


def test_a_zero_checkpoint_whose_universal_conversion_fails_ends_the_attempt_with_the_reason(repo, runs_root, monkeypatch):
    """A ZeRO-2 checkpoint of 2 ranks resumed on 1: rank 0 converts it before the rendezvous; this
    one has no DeepSpeed files, so the conversion fails and the attempt ends, not requeued, with
    DeepSpeed's error in the ledger."""
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.task.entry import run_task

    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), ["model.config.n_layer=1", "trainer.strategy=deepspeed",
                             "trainer.zero_stage=2"], devices=1, max_steps=10, name="gate-zero", environ=dict(os.environ),
                             say=lambda *_: None)
    for k, v in {"LMTRAIN_LAUNCHER": "local", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29556", "LMTRAIN_JOB_ID": f"local-test-{time.time()}",
                 "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(k, v)
    _fake_zero_checkpoint(plan)
    assert run_task(plan.paths.run_dir) == 2
    end = _ledger(plan)[-1]
    assert (end["reason"], end["requeued"]) == ("crashed", False)
    assert "ZeRO-2 on 2 ranks and this attempt runs deepspeed on 1" in end["detail"]
    assert "else through DeepSpeed's universal checkpoint, and converting it failed (FileNotFoundError" in end["detail"]


def test_a_signal_before_training_starts_is_kept_and_acted_on(monkeypatch, tmp_path):
    """The task owns the signals from its first line (submitit's USR2 handler would requeue from
    inside the handler): a warning that arrives before the Trainer exists becomes a stop."""
    from types import SimpleNamespace

    from lmtrain.preemption.controller import Preemption
    from lmtrain.preemption.signals import own_signals

    before = signal.getsignal(signal.SIGUSR2)
    plan = SimpleNamespace(preemption=PreemptionPlan.of(PreemptionSpec(signal="USR2")), trainer={"max_steps": 10},
                           paths=SimpleNamespace(run_dir=str(tmp_path), logs_dir=str(tmp_path / "logs"),
                                                 checkpoint_dir=str(tmp_path / "checkpoints")))
    early = own_signals({"signal": "USR2"})
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)
        env = SimpleNamespace(rank=0, launcher="local", job_id="x", restart_count=0, nodes=("h",))
        ctl = Preemption(plan, env, attempt=1)
        stop = ctl.stop
        assert ctl.signals is early and stop.requested and stop.reason == "timeout" and stop.armed
        assert ctl.signals.record.warning_at is not None
    finally:
        early.restore()
    assert signal.getsignal(signal.SIGUSR2) is before


@pytest.mark.parametrize("retired", [False, True, "after_end"], ids=["handlers-given-back", "retired", "after-end"])
def test_a_time_limit_warning_after_the_attempt_ended_does_not_kill_the_exiting_task(retired):
    """Seen in a parallel suite run: a run completed at step 70, then SLURM's time-limit warning
    (SIGUSR2, sent up to a minute early) reached its tasks while they exited, after the attempt
    gave the handlers back, and killed them: SLURM recorded the finished job FAILED. The task's
    process body retires the signals (lmtrain.preemption.signals.retire); a real child process shows both."""

    from lmtrain.preemption import signals

    pid = os.fork()
    if pid == 0:  # the task process: owns the signals, ends its attempt, gets the late warning
        try:
            signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # what submitit's task process starts with
            owner = signals.own_signals({"signal": "USR2"})
            if retired == "after_end":  # the attempt's own end retires them (seen again: a warning
                # between after_end and the process body's retire, while the process groups closed)
                from types import SimpleNamespace

                from lmtrain.preemption.controller import Preemption

                Preemption.after_end(SimpleNamespace(env=SimpleNamespace(rank=1, launcher="slurm"), signals=owner),
                                     SimpleNamespace(action=None))
            else:
                owner.restore()  # the attempt ended: handlers given back
            if retired is True:
                signals.retire()
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.2)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if retired:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    else:  # the failure retire() prevents
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR2, status


def test_a_stop_requested_by_a_peer_without_a_signal_gets_a_ledger_reason():
    d = decide(_facts(requested_reason="peer", launcher="local", slurm_state=None), POLICY)
    assert d.reason == "preempted" and "stop requested (peer)" in d.detail
    d = decide(_facts(requested_reason="timeout", launcher="local", slurm_state=None), POLICY)
    assert d.reason == "timeout"


def test_a_failing_decision_still_lets_the_attempt_end(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lmtrain.observe.attempt import Outcome
    from lmtrain.preemption.controller import Preemption

    plan = SimpleNamespace(preemption=PreemptionPlan("USR2", 120, 20, 10, 2, 3, False, 30),
                           trainer=SimpleNamespace(max_steps=10),
                           paths=SimpleNamespace(run_dir=str(tmp_path), logs_dir=str(tmp_path / "logs"),
                                                 checkpoint_dir=str(tmp_path), ledger=str(tmp_path / "attempts.jsonl")))
    env = SimpleNamespace(rank=0, launcher="local", job_id="1", restart_count=0, nodes=("h",))
    ctl = Preemption(plan, env, attempt=1)
    outcome = Outcome(reason="completed", end_step=3)
    def bug(*_):
        raise KeyError("a bug inside")

    monkeypatch.setattr("lmtrain.preemption.controller.decide", bug)
    ctl.settle(outcome, 0)  # caught, logged
    assert outcome.reason == "completed" and "preemption decision failed" in outcome.detail
    ctl.after_end(outcome)  # nothing to do; restores the handlers


def test_an_attempt_that_fails_before_training_gives_the_signal_handlers_back(local_run, monkeypatch):
    from lmtrain.task.entry import run_task

    monkeypatch.setenv("WORLD_SIZE", "2")  # not the plan's topology
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)
    with pytest.raises(RuntimeError, match="world_size 2"):
        run_task(local_run.paths.run_dir)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)) == before


def test_a_node_failure_keeps_the_requeued_job_off_the_failed_node_while_it_still_fits():
    # SLURM requeues a job whose node failed by itself: the job is pending while rank 0 ends
    base = dict(stopped=False, crashed=True, term=True, seconds_left=900.0, slurm_state="REQUEUED",
                nodes_down=["n2"], bad_nodes=["n2"], partition_nodes=["n1", "n2", "n3"], job_nodes=2)
    d = decide(_facts(**base), POLICY)
    assert (d.reason, d.requeued, d.action, d.exclude) == ("node_failure", True, None, ["n2"])
    assert "n2 kept out of the requeued job (ExcNodeList=n2)" in d.detail
    # nodes it already keeps off stay off
    d = decide(_facts(**{**base, "excluded": ["n3"], "partition_nodes": ["n1", "n2", "n3", "n4"]}), POLICY)
    assert d.exclude == ["n2", "n3"] and "n2 kept out" in d.detail
    # never so many that the job no longer fits its partition
    d = decide(_facts(**{**base, "partition_nodes": ["n1", "n2"]}), POLICY)
    assert d.exclude == [] and "n2 not excluded: the partition would keep 1 node(s) for a job of 2" in d.detail
    # the partition's nodes unknown: nothing excluded, and said
    d = decide(_facts(**{**base, "partition_nodes": None}), POLICY)
    assert d.exclude == [] and "not excluded: the partition's nodes are unknown" in d.detail
    # a job that requeues itself (scontrol requeue) is never pending while its rank 0 lives: said, not done
    d = decide(_facts(**{**base, "slurm_state": "RUNNING"}), POLICY)
    assert (d.action, d.exclude) == ("requeue", []) and "n2 not excluded: SLURM changes ExcNodeList only" in d.detail
    # a plain crash excludes nothing
    assert decide(_facts(stopped=False, crashed=True, bad_nodes=["n2"], partition_nodes=["n1", "n2", "n3"]),
                  POLICY).exclude == []
    # segments of 2 inside blocks of 2 (resources.placement): excluded while a whole block is left for it ...
    blocks = {"n1": "b1", "n2": "b1", "n3": "b2", "n4": "b2"}
    d = decide(_facts(**{**base, "job_nodes": 2, "segment": 2, "node_groups": blocks,
                         "partition_nodes": ["n1", "n2", "n3", "n4"]}), POLICY)
    assert d.exclude == ["n2"], d.detail
    # ... never when no block could hold the job's segments any more: SLURM would never start it
    d = decide(_facts(**{**base, "job_nodes": 4, "segment": 2, "node_groups": blocks, "nodes_down": ["n2"],
                         "partition_nodes": ["n1", "n2", "n3", "n4", "n5"]}), POLICY)
    assert d.exclude == [] and ("n2 not excluded: without it the blocks hold 1 whole segment(s) of 2 node(s), "
                                "the job needs 2") in d.detail, d.detail


def test_every_reader_of_a_slurm_state_takes_its_first_word_the_same_way():
    from lmcore.slurm.client import state_group, state_word

    assert [state_word(s) for s in ("CANCELLED by 0", "COMPLETING+", "running", "", None, "  ")] == [
        "CANCELLED", "COMPLETING", "RUNNING", "", "", ""]
    assert state_group("CANCELLED by 0") == "cancelled" and state_group("") == "unknown"
