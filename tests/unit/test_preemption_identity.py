"""Logger identity across attempts: the W&B run id is persisted in the run directory and reused;
a run started over at the same path gets a new one. (TensorBoard/CSV directories across real
attempts: test_preemption_signals.py.)"""

from __future__ import annotations

import multiprocessing as mp

from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmtrain.observe.loggers import WANDB_ID_FILE, logger_identity, make_loggers, wandb_run_id


def _id_in_child(run_dir, q) -> None:
    q.put(wandb_run_id(run_dir))


def test_wandb_run_id_is_persisted_and_reused_by_every_attempt_and_rank(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_id_in_child, args=(str(run), q)) for _ in range(4)]  # ranks racing
    for p in procs:
        p.start()
    ids = {q.get(timeout=HANG_S) for _ in procs}
    for p in procs:
        p.join()
    assert len(ids) == 1
    (first,) = ids
    assert (run / WANDB_ID_FILE).read_text().strip() == first
    assert wandb_run_id(str(run)) == first  # a later attempt
    assert logger_identity(str(run), {"wandb": {"project": "p"}})["wandb_id"] == first
    assert "wandb_id" not in logger_identity(str(run), {})
    assert not list(run.glob(".wandb_id.tmp-*"))


def test_a_run_started_over_at_the_same_path_gets_a_new_wandb_id(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old = wandb_run_id(str(run))
    run.rename(tmp_path / "run.archived")  # what --new does with the old run directory
    run.mkdir()
    assert wandb_run_id(str(run)) != old


def test_tensorboard_and_csv_loggers_use_fixed_version_directories(tmp_path):
    loggers = make_loggers(tmp_path, {"tensorboard": True, "csv": True}, "r")
    assert [(type(lg).__name__, lg.log_dir) for lg in loggers] == [
        ("TensorBoardLogger", str(tmp_path / "tensorboard" / "version_0")),
        ("ResumableCSVLogger", str(tmp_path / "csv" / "version_0")),
    ]
