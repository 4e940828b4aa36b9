"""A run killed in the middle of a background checkpoint write, resumed from the previous
checkpoint (itself written in the background), stopped at step k (through the stop-request path
preemption uses) and resumed again (its last periodic write still in flight when the final save
starts, which waits for it) gives bit-identical per-step losses, gradient norms and final
weights to a run that was never interrupted: DDP on 1 and 2 processes, and on 2 processes FSDP2
and DeepSpeed ZeRO 1, 2 and 3 (sharded checkpoints: every rank writes its own shards, in its own
writer thread for the periodic saves). Real processes through the real entry (lmtrain.local.launch),
CPU/gloo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import shared_results
import torch

from launcher.submit.local_run import prepare_local_run
from lmtrain.checkpoint.manager import complete_checkpoints
from lmtrain.checkpoint.weights import lightning_state_dict
from lmtrain.local.launch import launch
from tests.memory_helpers import assert_states_as_planned

HELPER = Path(__file__).with_name("_train_with_stop.py")
# Small enough for seconds per run; dropout stays on (GPT-2's 0.1) so the RNG restore matters.
OVERRIDES = [
    "model.config.n_layer=1",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.n_positions=32",
    "data.seq_len=32",
    "data.micro_batch_size=4",
    "trainer.global_batch_size=8",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=6",
    "trainer.limit_val_batches=2",
    "checkpoint.every_n_steps=5",
    "checkpoint.keep_last=2",
    "optim.warmup_steps=3",
]
MAX_STEPS = 12
STOP_AT = 6  # a validation step (trainer.val_check_interval=6), not a periodic checkpoint's


STRATEGIES = {
    "ddp": ["trainer.strategy=ddp"],
    "fsdp": ["trainer.strategy=fsdp"],
    "zero1": ["trainer.strategy=deepspeed", "trainer.zero_stage=1"],
    "zero2": ["trainer.strategy=deepspeed", "trainer.zero_stage=2"],
    "zero3": ["trainer.strategy=deepspeed", "trainer.zero_stage=3"],
}


def _plan(repo, name: str, devices: int, strategy: str = "ddp"):
    return prepare_local_run(
        str(repo / "jobs" / "tiny-cpu.yaml"), OVERRIDES + STRATEGIES[strategy], devices=devices, max_steps=MAX_STEPS,
        name=name, environ=dict(os.environ), say=lambda *_: None, resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir(),
    )


# A point inside a periodic save's writer thread (checkpoint.async_save is on by default): DDP's
# rank 0 once it wrote Lightning's file; a sharded strategy's rank 1 once its thread wrote its
# shard (rank 0's own writes go on meanwhile). The first attempt is SIGKILLed there at step 10;
# the last one sleeps there, so that the final (synchronous) save must finish it first.
IN_BACKGROUND_WRITE = {
    "ddp": {"point": "checkpoint.rank_saved", "rank": 0},
    "fsdp": {"point": "checkpoint.wrote", "file": "__1_0.distcp"},
    **{z: {"point": "checkpoint.wrote", "file": "zero_pp_rank_1_*"} for z in ("zero1", "zero2", "zero3")},
}


def straight_run(repo, devices: int, strategy: str):
    """The uninterrupted run of ``strategy`` on ``devices`` ranks (its plan): trained once per test
    run for every test and worker that compares with it or exports it (tests/shared_results.py), in
    a runs root of its own beside the shared results. Its users read its directory and write only
    its evaluator's scores (test_export)."""

    def train():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LMLAUNCH_RUNS_ROOT", str(shared_results.directory() / "straight-runs"))
            plan = _plan(repo, f"straight-{strategy}-{devices}", devices, strategy)
            assert _launch(plan, stop_at=0) == 0, Path(plan.paths.run_dir, "launcher.out").read_text()[-3000:]
        return plan

    return shared_results.shared(f"checkpoint-resume-straight-{strategy}-{devices}", train)


def _launch(plan, stop_at: int, faults: list[dict] | None = None) -> int:
    run_dir = plan.paths.run_dir
    env = {**plan.env, "LMLAUNCH_FAULTS": json.dumps(faults)} if faults else plan.env
    return launch(
        run_dir, plan.topology.world_size, plan_env=env, threads_per_proc=1,
        command=[sys.executable, "-u", str(HELPER), run_dir, str(stop_at)],
        out=open(Path(run_dir) / "launcher.out", "a"),
    )


def _steps(run_dir: str, redone: range = range(0)) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) per step; a step of ``redone`` (trained again after a kill) the last time."""
    out = {}
    for line in Path(run_dir, "metrics", "heartbeat.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["event"] == "step":
            assert d["step"] not in out or d["step"] in redone, f"step {d['step']} logged twice"
            out[d["step"]] = (d["loss"], d["grad_norm"])
    return out


def _val_losses(run_dir: str) -> dict[int, float]:
    beats = [json.loads(x) for x in Path(run_dir, "metrics", "heartbeat.jsonl").read_text().splitlines()]
    return {b["step"]: b["val_loss"] for b in beats if b["event"] == "val"}


def _final_weights(run_dir: str) -> dict[str, torch.Tensor]:
    last = complete_checkpoints(Path(run_dir) / "checkpoints")[-1]
    assert last.step == MAX_STEPS
    return lightning_state_dict(last.path)


def _ledger(run_dir: str) -> list[dict]:
    return [json.loads(x) for x in Path(run_dir, "attempts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "devices, strategy",
    [(1, "ddp"), *(pytest.param(2, s, marks=pytest.mark.slow) for s in STRATEGIES)],
    ids=["ddp-1", *(f"{s}-2" for s in STRATEGIES)],
)
def test_run_stopped_at_a_validation_step_and_resumed_is_bit_identical_to_uninterrupted(repo, runs_root, devices, strategy):
    straight = straight_run(repo, devices, strategy)  # the export test's run too
    assert json.loads(Path(straight.paths.plan_json).read_text())["topology"]["parallelism"]["strategy"] == strategy.rstrip("123").replace("zero", "deepspeed")
    # the Trainer got exactly the plan's Trainer arguments (what the dry run prints)
    built = json.loads(Path(straight.paths.run_dir, "trainer-args.json").read_text())
    assert built == straight.trainer.kwargs()
    if strategy.startswith("zero"):
        # the engine runs the plan's deepspeed.json, key for key
        engine = json.loads(Path(straight.paths.run_dir, "engine-deepspeed.json").read_text())
        assert engine == json.loads(Path(straight.paths.deepspeed_json).read_text())

    stopped = _plan(repo, f"stopped-{devices}", devices, strategy)
    kill = {**IN_BACKGROUND_WRITE[strategy], "step": 10, "attempt": 1, "action": "kill"}
    assert _launch(stopped, stop_at=0, faults=[kill]) != 0
    ckpt_dir = Path(stopped.paths.checkpoint_dir)
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [5]  # step-10 never completed
    assert any(x.name in ("step-10", ".step-10.tmp") for x in ckpt_dir.iterdir())  # the write it was killed in
    # rank 0 killed (DDP's writer, or the only rank): the next attempt says how this one ended;
    # rank 1 killed: rank 0, which lived on, says so itself
    rank0_killed = devices == 1 or IN_BACKGROUND_WRITE[strategy].get("rank") == 0
    if not rank0_killed:
        end = _ledger(stopped.paths.run_dir)[-1]
        assert (end["event"], end["reason"], end["first_death"]["rank"]) == ("end", "crashed", 1), end
        assert "resumes from checkpoint step-5" in end["detail"]

    # from step-5 (a background save), stopped at step 6: a validation step (val_check_interval 6),
    # whose stop checkpoint is taken before validation would run (validation must not move the
    # training random stream, or the uninterrupted run's step 7 differs: lmtrain.observe.callbacks)
    assert _launch(stopped, stop_at=STOP_AT) == 0
    ledger = _ledger(stopped.paths.run_dir)
    assert ledger[-1]["reason"] == "preempted" and ledger[-1]["end_step"] == STOP_AT
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [5, STOP_AT]
    assert not Path(stopped.paths.run_dir, "DONE").exists()

    slow = {**IN_BACKGROUND_WRITE[strategy], "step": 10, "attempt": 3, "action": "sleep", "seconds": 2}
    assert _launch(stopped, stop_at=0, faults=[slow]) == 0
    # step-10's write was still in flight while steps 11 and 12 trained; the final save waited for it
    beats = [json.loads(x) for x in Path(stopped.paths.heartbeat).read_text().splitlines()]
    order = [(b["event"], b.get("step")) for b in beats if b.get("attempt") == 3]
    assert order.index(("step", 11)) < order.index(("checkpoint", 10)) < order.index(("checkpoint", 12)), order
    ledger = _ledger(stopped.paths.run_dir)
    # the rank that lived on ended at the step it reached (10 or later: it went on while rank 1's thread wrote)
    assert [(e["event"], e.get("start_step"), min(e.get("end_step") or 0, 10) if e.get("reason") == "crashed" else
             e.get("end_step"), e.get("reason")) for e in ledger if e["event"] not in ("startup", "preflight", "memory")] == [
        ("start", 0, None, None), ("end", None, 5, "node_failure") if rank0_killed else ("end", None, 10, "crashed"),
        ("start", 5, None, None), ("end", None, STOP_AT, "preempted"),
        ("start", STOP_AT, None, None), ("end", None, MAX_STEPS, "completed"),
    ]
    assert Path(stopped.paths.run_dir, "DONE").exists()

    # 6-10 trained again, and whatever the first attempt trained on top of 10 while the writer thread
    # that was killed still wrote (under load both ranks may reach step 12 before it gets there)
    a, b = _steps(straight.paths.run_dir), _steps(stopped.paths.run_dir, redone=range(6, MAX_STEPS + 1))
    assert sorted(a) == sorted(b) == list(range(1, MAX_STEPS + 1))
    assert a == b  # bit-identical floats: losses and gradient norms of every step
    wa, wb = _final_weights(straight.paths.run_dir), _final_weights(stopped.paths.run_dir)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _val_losses(straight.paths.run_dir)[MAX_STEPS] == _val_losses(stopped.paths.run_dir)[MAX_STEPS]
    # keep_last=2: of 5, 6, 10, 12 only the newest two remain
    assert [c.step for c in complete_checkpoints(stopped.paths.checkpoint_dir)] == [10, 12]
    # what each rank held (the ledger's memory line of every attempt) is what the plan said
    assert_states_as_planned(straight.paths.run_dir)
    assert_states_as_planned(stopped.paths.run_dir, attempts=2)  # attempt 2 trains one step: measured at its second


def test_the_loss_logged_across_stops_is_the_uninterrupted_runs(repo, runs_root):
    """The logged loss is the mean over the logging window (every 4 steps here): a run stopped in
    the middle of one (step 6) and at the end of one (step 8) logs the same means at 4, 8 and 12
    as a run that never stopped (each checkpoint carries its rank's window so far)."""
    every4 = ["trainer.log_every_n_steps=4"]

    def plan(name):
        return prepare_local_run(
            str(repo / "jobs" / "tiny-cpu.yaml"), OVERRIDES + every4, devices=1, max_steps=MAX_STEPS, name=name,
            environ=dict(os.environ), say=lambda *_: None, resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir())

    straight = plan("straight-every4")
    assert _launch(straight, stop_at=0) == 0
    for stop_at in (6, 8, 0):
        stopped = plan("stopped-every4")
        assert _launch(stopped, stop_at=stop_at) == 0
    assert [(e.get("start_step"), e.get("end_step")) for e in _ledger(stopped.paths.run_dir)
            if e["event"] in ("start", "end")] == [(0, None), (None, 6), (6, None), (None, 8), (8, None), (None, 12)]
    a, b = _steps(straight.paths.run_dir), _steps(stopped.paths.run_dir)
    assert sorted(a) == [4, 8, 12] and a == b  # bit-identical means (and gradient norms)
