"""Continuing a finished run to a larger trainer.max_steps: the submit-time check and the note
that says how the learning-rate schedule goes on (launcher.submit.lifecycle.continuation_note)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from launcher.submit.lifecycle import continuation_note
from lmcore.errors import UserError
from lmcore.job.lr_schedule import OptimSettings, extension_note, lr_at

OPTIM = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 10,
         "schedule": "cosine", "min_lr": 3e-4}


def _plan(tmp_path, max_steps: int, old_max: int | None = 150):
    plan_json = tmp_path / "plan.json"
    if old_max is not None:
        plan_json.write_text(json.dumps({"trainer": {"max_steps": old_max}, "spec": {"optim": OPTIM}}))
    return SimpleNamespace(run_name="r", trainer=SimpleNamespace(max_steps=max_steps), spec={"optim": OPTIM},
                           paths=SimpleNamespace(plan_json=str(plan_json), run_dir=str(tmp_path),
                                                 checkpoint_dir=str(tmp_path / "checkpoints")))


def test_a_run_that_did_not_finish_needs_no_note(tmp_path):
    assert continuation_note(_plan(tmp_path, 300)) is None


def test_a_finished_run_without_a_larger_max_steps_is_refused_before_submission(tmp_path):
    (tmp_path / "DONE").write_text("150\n")
    with pytest.raises(UserError, match=r"already finished at step 150 and trainer.max_steps is 150: nothing to train.*trainer.max_steps=300"):
        continuation_note(_plan(tmp_path, 150))


def test_continuing_a_finished_run_says_where_the_schedule_goes(tmp_path):
    (tmp_path / "DONE").write_text("150\n")
    note = continuation_note(_plan(tmp_path, 300))
    new = OptimSettings.from_spec(OPTIM, 300)
    assert note == (
        "continuing from step 150 to trainer.max_steps(300); the learning-rate schedule (cosine, warmup 10) "
        f"is recomputed over max_steps 300 instead of 150: step 150 ran at 0.0003, step 151 runs at "
        f"{lr_at(150, new):.3g}, and it reaches min_lr(0.0003) at step 300"
    )


def test_a_constant_schedule_stays_constant():
    optim = {**OPTIM, "schedule": "constant"}
    assert extension_note(optim, optim, step=150, old_max_steps=150, new_max_steps=300).endswith(
        "the learning rate stays constant at 0.003")


@pytest.mark.slow
def test_a_finished_local_run_resumed_with_a_larger_max_steps_trains_on(repo, runs_root):
    """`run --local --resume --max-steps 8` of a run that finished at step 4: trains steps 5-8 from
    the step-4 checkpoint (the same gate a requeued or resubmitted SLURM job goes through)."""
    import io

    from launcher.cli import main
    from launcher.context import Context

    def run(*extra: str) -> tuple[int, str]:
        out = io.StringIO()
        code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--devices", "2", "--name", "cont",
                     "model.config.n_layer=1", "trainer.log_every_n_steps=1", *extra],
                    Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)}))
        return code, out.getvalue()

    code, text = run("--max-steps", "4")
    assert code == 0, text[-3000:]
    code, text = run("--max-steps", "4", "--resume")
    assert code == 2 and "already finished at step 4 and trainer.max_steps is 4: nothing to train" in text
    code, text = run("--max-steps", "8", "--resume")
    assert code == 0, text[-3000:]
    assert "notice: continuing from step 4 to trainer.max_steps(8)" in text
    run_dir = runs_root / "cont"
    ledger = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("start_step"), e.get("end_step"), e.get("reason")) for e in ledger] == [
        ("start", 0, None, None), ("preflight", None, None, None), ("startup", None, None, None),
        ("memory", None, None, None), ("end", None, 4, "completed"),
        ("start", 4, None, None), ("preflight", None, None, None), ("startup", None, None, None),
        ("memory", None, None, None), ("end", None, 8, "completed")]
    startups = [e for e in ledger if e["event"] == "startup"]
    assert startups[0]["checkpoint_bytes"] is None and startups[1]["checkpoint_bytes"] > 0  # resumed from step-4
    assert (run_dir / "DONE").read_text().strip() == "8"
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics" / "heartbeat.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "step"]
    assert steps == list(range(1, 9))
