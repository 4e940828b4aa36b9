"""Real signals to real local training processes (lmtrain.local.launch's environment, gloo, CPU): the
handler records, all ranks agree at the next step boundary through one collective, the
checkpoint is complete on every rank, the ledger says why, and a run resumed after two stops is
bit-identical to one that never stopped (per-step losses, gradient norms, final weights), with
the same TensorBoard and CSV directories.

Signals come two ways: sent by the rank process to itself at a known step (the helper
``_preempt_worker.py``), and sent from here with ``os.kill`` while the run trains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import waiting
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.submit.local_run import prepare_local_run
from lmcore.run.rank_logs import rank_text
from lmtrain.checkpoint.manager import complete_checkpoints
from lmtrain.distributed.task_env import free_port
from lmtrain.local.launch import worker_env
from tests import rank_procs
from tests.trackers import assert_trackers_log_each_step_once

HELPER = Path(__file__).with_name("_preempt_worker.py")
MAX_STEPS = 30
OVERRIDES = [
    "model.config.n_layer=1",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.n_positions=32",
    "data.seq_len=32",
    "data.micro_batch_size=4",
    "trainer.global_batch_size=8",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=null",
    "checkpoint.every_n_steps=100",  # only the stop checkpoints and the final one
    "checkpoint.keep_last=5",
    "optim.warmup_steps=3",
]


def _plan(repo, name: str, devices: int, *extra: str):
    return prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), [*OVERRIDES, *extra], devices=devices, max_steps=MAX_STEPS,
                             name=name, environ=dict(os.environ), say=lambda *_: None, resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir())


def _start(plan, *args: str) -> list[subprocess.Popen]:
    run_dir = plan.paths.run_dir
    n = plan.topology.world_size
    port, job_id = free_port("127.0.0.1"), f"local-test-{time.time_ns()}"
    out = open(Path(run_dir) / "ranks.out", "ab")
    return [
        rank_procs.start([sys.executable, "-u", str(HELPER), run_dir, *args], out=out,
                         env=worker_env(r, n, port=port, job_id=job_id, plan_env=plan.env, threads=1))
        for r in range(n)
    ]


def _wait(procs: list[subprocess.Popen], run_dir: str) -> None:
    try:
        codes = [p.wait(timeout=HANG_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * len(procs), f"{codes}\n" + Path(run_dir, "ranks.out").read_text()[-4000:]


def _run(plan, *args: str) -> None:
    _wait(_start(plan, *args), plan.paths.run_dir)


def _jsonl(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _wait_for_step(plan, attempt: int, step: int, procs) -> None:
    """Until the heartbeat shows ``step`` of ``attempt``, while the ranks compute or log."""
    hb = Path(plan.paths.heartbeat)

    def reached() -> bool:
        assert all(p.poll() is None for p in procs), "a rank exited before the signal"
        return hb.exists() and any(e["event"] == "step" and e["attempt"] == attempt and e["step"] >= step
                                   for e in _jsonl(hb))

    waiting.until(reached, progress=waiting.watching(waiting.file_grows(hb), *(waiting.process_cpu(p.pid) for p in procs)),
                  poll=0.05, what=f"attempt {attempt} at step {step}")


def _ends(plan) -> list[dict]:
    return [e for e in _jsonl(plan.paths.ledger) if e["event"] == "end"]


def _stop_logged(plan, attempt: int, rank: int) -> int:
    text = rank_text(Path(plan.paths.logs_dir, f"attempt-{attempt}"), rank)
    return int(text.split("stop agreed at step ")[1].split()[0])


def _steps(plan) -> dict[int, tuple[float, float]]:
    out: dict[int, tuple[float, float]] = {}
    for e in _jsonl(plan.paths.heartbeat):
        if e["event"] == "step":
            assert e["step"] not in out, f"step {e['step']} logged twice"
            out[e["step"]] = (e["loss"], e["grad_norm"])
    return out


def _final_weights(plan) -> dict[str, torch.Tensor]:
    last = complete_checkpoints(plan.paths.checkpoint_dir)[-1]
    assert last.step == MAX_STEPS
    return torch.load(last.lightning_path, map_location="cpu", weights_only=True)["state_dict"]


def test_two_signalled_stops_resume_bit_identical_to_an_uninterrupted_run(repo, runs_root):
    straight = _plan(repo, "straight", 1)
    run = _plan(repo, "signalled", 1)
    # the reference run, and attempt 1 of the signalled run beside it (one process each):
    # the warning signal arrives during step 11 -> stop, checkpoint step-11
    reference = _start(straight)
    _run(run, "11:0:USR2")
    _wait(reference, straight.paths.run_dir)
    end = _ends(run)[-1]
    assert (end["reason"], end["end_step"], end["stop_step"], end["signal"]) == ("timeout", 11, 11, "SIGUSR2")
    assert 0 <= end["checkpoint_seconds"] < 30 and end["signal_time"] <= end["time"]
    assert [c.step for c in complete_checkpoints(run.paths.checkpoint_dir)] == [11]
    # attempt 2: SIGTERM from outside while it trains (steps slowed from step 15 so it cannot finish first)
    procs = _start(run, "sleep:15:0.3")
    _wait_for_step(run, 2, 16, procs)
    os.kill(procs[0].pid, signal.SIGTERM)
    _wait(procs, run.paths.run_dir)
    end = _ends(run)[-1]
    stopped_at = end["end_step"]
    assert end["reason"] == "preempted" and end["signal"] == "SIGTERM" and 16 <= stopped_at < MAX_STEPS
    assert complete_checkpoints(run.paths.checkpoint_dir)[-1].step == stopped_at
    # attempt 3: to the end
    _run(run)
    ledger = _jsonl(run.paths.ledger)
    assert [(e["event"], e.get("start_step"), e.get("end_step"), e.get("reason")) for e in ledger
            if e["event"] not in ("startup", "preflight", "memory")] == [
        ("start", 0, None, None), ("end", None, 11, "timeout"),
        ("start", 11, None, None), ("end", None, stopped_at, "preempted"),
        ("start", stopped_at, None, None), ("end", None, MAX_STEPS, "completed"),
    ]
    assert all(e["requeued"] is False for e in ledger if e["event"] == "end")  # local runs never requeue
    assert Path(run.paths.run_dir, "DONE").exists()
    hb = _jsonl(run.paths.heartbeat)
    assert [e["event"] for e in hb].count("end") == 3 and any(e["event"] == "checkpoint" for e in hb)
    # no validation on the way out of a stop (Lightning's should_stop validation is skipped):
    # only the final one, as in the uninterrupted run
    assert [e["step"] for e in hb if e["event"] == "val"] == [MAX_STEPS]
    assert [e["step"] for e in _jsonl(straight.paths.heartbeat) if e["event"] == "val"] == [MAX_STEPS]

    a, b = _steps(straight), _steps(run)
    assert sorted(a) == sorted(b) == list(range(1, MAX_STEPS + 1))
    assert a == b  # bit-identical losses and gradient norms at every step
    wa, wb = _final_weights(straight), _final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # the logger identity survived: one TensorBoard version dir, one CSV that every attempt appended to
    assert sorted(p.name for p in Path(run.paths.run_dir, "tensorboard").iterdir()) == ["version_0"]
    assert sorted(p.name for p in Path(run.paths.run_dir, "csv").iterdir()) == ["version_0"]
    rows = Path(run.paths.run_dir, "csv", "version_0", "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged_steps = {int(r.split(",")[header.index("step")]) for r in rows[1:] if r.split(",")[header.index("step")]}
    assert min(logged_steps) < 11 and max(logged_steps) >= MAX_STEPS - 1 and any(11 < s < stopped_at for s in logged_steps)


def test_a_signal_to_one_rank_stops_both_ranks_at_the_same_step(repo, runs_root):
    run = _plan(repo, "one-rank", 2)
    # only rank 1 gets the warning signal, during step 5
    _run(run, "5:1:USR2")
    assert _stop_logged(run, 1, 0) == _stop_logged(run, 1, 1) == 5
    end = _ends(run)[-1]
    assert (end["reason"], end["end_step"], end["signal"]) == ("timeout", 5, "SIGUSR2")  # rank 0 learned it
    ckpt = complete_checkpoints(run.paths.checkpoint_dir)[-1]
    assert ckpt.step == 5 and {p.name for p in ckpt.path.iterdir()} >= {"rank-0.pt", "rank-1.pt", "COMPLETE"}

    # SIGTERM from outside to rank 1 only, while both train
    procs = _start(run, "sleep:8:0.3")
    _wait_for_step(run, 2, 9, procs)
    os.kill(procs[1].pid, signal.SIGTERM)
    _wait(procs, run.paths.run_dir)
    end = _ends(run)[-1]
    step = end["end_step"]
    assert end["reason"] == "preempted" and end["signal"] == "SIGTERM" and 9 <= step < MAX_STEPS
    assert _stop_logged(run, 2, 0) == _stop_logged(run, 2, 1) == step
    ckpt = complete_checkpoints(run.paths.checkpoint_dir)[-1]
    assert ckpt.step == step and ckpt.rank_state(1)["step"] == ckpt.rank_state(0)["step"] == step


def test_a_stops_checkpoint_holds_training_for_its_copy_and_the_attempt_ends_once_it_is_durable(repo, runs_root):
    """checkpoint.async_save (the default): SIGTERM to both ranks during step 5, no periodic save
    before it. The stop's save holds training only while rank 0 copies the state into host memory
    (buffers reserved at the first step boundary); its writer thread is slowed by 2 s here (a slow
    disk), and the attempt still ends, and would requeue, only after COMPLETE is on disk."""
    run = _plan(repo, "staged-stop", 2)
    slow_write = [{"point": "checkpoint.rank_saved", "step": 5, "rank": 0, "action": "sleep", "seconds": 2.0}]
    port, n = free_port("127.0.0.1"), 2
    env = {**run.env, "LMLAUNCH_FAULTS": json.dumps(slow_write)}
    out = open(Path(run.paths.run_dir) / "ranks.out", "ab")
    procs = [rank_procs.start([sys.executable, "-u", str(HELPER), run.paths.run_dir, f"5:{r}:TERM"], out=out,
                              env=worker_env(r, n, port=port, job_id="local-staged-stop", plan_env=env, threads=1))
             for r in range(n)]
    _wait(procs, run.paths.run_dir)
    end = _ends(run)[-1]
    assert (end["reason"], end["end_step"], end["stop_step"]) == ("preempted", 5, 5)
    assert end["checkpoint_held_s"] + 1.5 < end["checkpoint_seconds"]  # the 2 s write came after training let go
    save = [e for e in _jsonl(run.paths.heartbeat) if e["event"] == "checkpoint"][-1]
    assert save["step"] == 5 and save["blocked_s"] + 1.5 < save["seconds"]
    ckpt = complete_checkpoints(run.paths.checkpoint_dir)[-1]
    assert ckpt.step == 5 and (ckpt.path / "COMPLETE").stat().st_mtime <= end["time"]  # durable before the end
    log0 = rank_text(Path(run.paths.logs_dir, "attempt-1"), 0)
    assert "staging buffers reserved" in log0  # at step 1, so the stop's save allocated nothing


def test_agreeing_every_k_steps_stops_both_ranks_at_the_next_kth_step(repo, runs_root):
    """preemption.agree_every_n_steps=4: the warning during step 5 (to rank 1 only) stops both
    ranks at step 8, the first agreement boundary after it; the next attempt goes on from there."""
    run = _plan(repo, "every-4", 2, "preemption.agree_every_n_steps=4")
    assert run.preemption.agree_every_n_steps == 4
    _run(run, "5:1:USR2")
    assert _stop_logged(run, 1, 0) == _stop_logged(run, 1, 1) == 8
    end = _ends(run)[-1]
    assert (end["reason"], end["end_step"], end["stop_step"], end["signal"]) == ("timeout", 8, 8, "SIGUSR2")
    assert [c.step for c in complete_checkpoints(run.paths.checkpoint_dir)] == [8]
    _run(run)
    assert [(e["reason"], e["end_step"]) for e in _ends(run)] == [("timeout", 8), ("completed", MAX_STEPS)]
    assert sorted(_steps(run)) == list(range(1, MAX_STEPS + 1))


@pytest.mark.parametrize("point", ["checkpoint.staged", "checkpoint.rank_saved", "checkpoint.dir_renamed"])
def test_a_run_killed_during_a_background_checkpoint_resumes_bit_identical(repo, runs_root, point):
    """Periodic checkpoints every 4 steps are written in the background (checkpoint.async_save):
    SIGKILL at step-8's save, after the state was copied to host memory (checkpoint.staged),
    after the writer thread wrote Lightning's file (checkpoint.rank_saved), or after it renamed
    the directory but before COMPLETE (checkpoint.dir_renamed): step-4 stays the newest complete
    checkpoint, and the run resumed from it is bit-identical to one never interrupted."""
    extra = ("checkpoint.every_n_steps=4", "checkpoint.keep_last=3")
    straight, killed = _plan(repo, "bg-straight", 1, *extra), _plan(repo, "bg-killed", 1, *extra)
    reference = _start(straight)
    env = {**killed.env, "LMLAUNCH_FAULTS": json.dumps([{"point": point, "step": 8, "action": "kill"}])}
    p = rank_procs.start([sys.executable, "-u", str(HELPER), killed.paths.run_dir],
                         env=worker_env(0, 1, port=free_port("127.0.0.1"), job_id="local-bg-killed", plan_env=env,
                                        threads=1))
    assert p.wait(timeout=HANG_S) == -signal.SIGKILL
    _wait(reference, straight.paths.run_dir)
    ckpt_dir = Path(killed.paths.checkpoint_dir)
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [4]
    assert any(x.name in (".step-8.tmp", "step-8") for x in ckpt_dir.iterdir())  # the write it was killed in

    _run(killed)
    assert [(e["reason"], e["end_step"]) for e in _ends(killed)] == [("node_failure", 4), ("completed", MAX_STEPS)]
    latest: dict[int, tuple[float, float]] = {}  # steps 5.. were logged by both attempts: the resumed run's
    for e in _jsonl(killed.paths.heartbeat):
        if e["event"] == "step":
            latest[e["step"]] = (e["loss"], e["grad_norm"])
    assert latest == _steps(straight)  # bit-identical losses and gradient norms at every step
    wa, wb = _final_weights(straight), _final_weights(killed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [24, 28, MAX_STEPS]
    # the metrics of steps 0-3 were on disk before the kill (flushed after step-4's checkpoint)
    assert_trackers_log_each_step_once(Path(killed.paths.run_dir), MAX_STEPS)


def test_sigkill_in_the_middle_of_a_real_checkpoint_write_resumes_from_the_previous_complete_one(repo, runs_root):
    """A real training process SIGKILLed inside its second periodic checkpoint (every 5 steps; a
    1-rank save passes about 24 kill points, so the 30th is inside step-10's write): no end line
    is written; the next attempt records the killed one, skips the partial step-10 and resumes
    from step-5."""
    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), [*OVERRIDES, "checkpoint.every_n_steps=5"],
                             devices=1, max_steps=12, name="killed", environ=dict(os.environ),
                             say=lambda *_: None)
    env = {**plan.env, "LMLAUNCH_FAULTS": json.dumps([{"point": "checkpoint.*", "nth": 30, "action": "kill"}])}
    port = free_port("127.0.0.1")
    p = rank_procs.start([sys.executable, "-u", str(HELPER), plan.paths.run_dir],
                         env=worker_env(0, 1, port=port, job_id="local-killed", plan_env=env, threads=1))
    assert p.wait(timeout=HANG_S) == -signal.SIGKILL
    ckpt_dir = Path(plan.paths.checkpoint_dir)
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [5]
    assert any(x.name in ("step-10", ".step-10.tmp") for x in ckpt_dir.iterdir())  # the partial write
    assert [e["event"] for e in _jsonl(plan.paths.ledger)] == ["start", "preflight", "startup", "memory"]

    _run(plan)
    ledger = _jsonl(plan.paths.ledger)
    assert [(e["event"], e["attempt"], e.get("start_step"), e.get("end_step"), e.get("reason")) for e in ledger
            if e["event"] not in ("startup", "preflight", "memory")] == [
        ("start", 1, 0, None, None), ("end", 1, None, 5, "node_failure"),
        ("start", 2, 5, None, None), ("end", 2, None, 12, "completed"),
    ]
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [5, 10, 12]
    assert sorted(x.name for x in ckpt_dir.iterdir()) == ["latest", "step-10", "step-12", "step-5"]  # no debris
    # attempt 1 logged steps 6-10 and died; attempt 2 trained them again from step-5: each once
    assert_trackers_log_each_step_once(Path(plan.paths.run_dir), 12)


# Run as the SLURM task's process body is: submitit's handler already installed (submitit's
# process_job installs it before calling the task), then lmtrain.task.train_task.TrainTask called. An import
# hook notes which handler owns the warning signal when the first slow module starts importing,
# and stops the task there.
_WINDOW_PROBE = r"""
import json, signal, sys
SLOW = ("torch", "lightning", "transformers", "deepspeed", "numpy", "pydantic", "lmcore.job.plan",
        "lmcore.job.spec", "lmtrain.preemption.controller", "lmtrain.observe.callbacks", "lmtrain.distributed.task_env")
seen = {}
def checkpoint_and_try_requeue(signum, frame):  # submitit's handler, by name
    seen["submitit_ran"] = True
class FirstSlowImport(Exception):
    pass
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name in SLOW:
            seen["module"] = name
            seen["handler"] = getattr(signal.getsignal(getattr(signal, sys.argv[2])), "__qualname__", None)
            raise FirstSlowImport(name)
signal.signal(getattr(signal, sys.argv[2]), checkpoint_and_try_requeue)
sys.meta_path.insert(0, Probe())
from lmtrain.task.train_task import TrainTask
try:
    TrainTask(sys.argv[1])()
except FirstSlowImport:
    pass
print(json.dumps(seen))
"""


@pytest.mark.parametrize("warning", ["USR2", "USR1"])
def test_the_task_owns_the_warning_signal_before_its_first_slow_import(repo, runs_root, warning):
    """Seen in a parallel CI run: SLURM's time-limit warning reached a task while it imported
    torch and Lightning, still under submitit's handler, which ended it with "timed-out and not
    checkpointable" (no requeue, the job ended TIMEOUT). The task's first act is to take the
    signal over; nothing slow (torch, Lightning, transformers, pydantic, the plan's classes) is
    imported before it, for whichever warning signal the plan names."""
    plan = _plan(repo, f"window-{warning.lower()}", 1, f"preemption.signal={warning}")
    out = subprocess.run([sys.executable, "-c", _WINDOW_PROBE, plan.paths.run_dir, f"SIG{warning}"],
                         capture_output=True, text=True, timeout=HANG_S, cwd=repo)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen.get("module"), seen  # the task did reach a slow import
    assert seen["handler"] == "SignalOwner._handle", seen
