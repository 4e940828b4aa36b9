"""Continuing a finished run to a larger trainer.max_steps: the submit-time check and the note
that says how the learning-rate schedule goes on (launcher.submit.continuation_note)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from launcher.errors import UserError
from launcher.lr_schedule import OptimSettings, extension_note, lr_at
from launcher.submit import continuation_note

OPTIM = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 10,
         "schedule": "cosine", "min_lr": 3e-4}


def _plan(tmp_path, max_steps: int, old_max: int | None = 150):
    plan_json = tmp_path / "plan.json"
    if old_max is not None:
        plan_json.write_text(json.dumps({"trainer": {"max_steps": old_max}, "spec": {"optim": OPTIM}}))
    return SimpleNamespace(run_name="r", trainer={"max_steps": max_steps}, spec={"optim": OPTIM},
                           paths=SimpleNamespace(plan_json=str(plan_json)))


def test_a_run_that_did_not_finish_needs_no_note(tmp_path):
    assert continuation_note(_plan(tmp_path, 300), tmp_path) is None


def test_a_finished_run_without_a_larger_max_steps_is_refused_before_submission(tmp_path):
    (tmp_path / "DONE").write_text("150\n")
    with pytest.raises(UserError, match=r"already finished at step 150 and trainer.max_steps is 150: nothing to train.*trainer.max_steps=300"):
        continuation_note(_plan(tmp_path, 150), tmp_path)


def test_continuing_a_finished_run_says_where_the_schedule_goes(tmp_path):
    (tmp_path / "DONE").write_text("150\n")
    note = continuation_note(_plan(tmp_path, 300), tmp_path)
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
