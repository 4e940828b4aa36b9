"""The checkpoint protocol on disk: complete-marked step dirs, the latest pointer, keep_last,
incomplete directories ignored, per-rank RNG state round trip, and the ZeRO world-size check.
Uses a real (single-process) Lightning Trainer."""

from __future__ import annotations

import json
import random
import shutil

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lmcore.job.parallelism import Parallelism
from lmtrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    check_compatible,
    complete_checkpoints,
    newest_complete,
)
from lmtrain.checkpoint.rng_state import capture_rng, restore_rng


class SaveEveryStep(pl.Callback):
    def __init__(self, manager):
        self.manager = manager

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.manager.save(trainer, step=trainer.global_step, rank_state={"rng": capture_rng(), "data_sampler": {"pos": batch_idx}})


def _train_saving_each_step(ckpt_dir, steps: int, keep_last: int):
    manager = CheckpointManager(ckpt_dir, keep_last=keep_last, every_n_steps=1, parallelism=Parallelism.of("ddp", 1),
                                identity={"job_id": "7", "attempt": 1})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveEveryStep(manager)])
    trainer.fit(BoringModel())
    return manager


def test_complete_checkpoints_latest_pointer_and_keep_last(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _train_saving_each_step(ckpt, steps=4, keep_last=2)
    assert [c.step for c in complete_checkpoints(ckpt)] == [3, 4]
    assert (ckpt / "latest").read_text().strip() == "step-4"
    newest = newest_complete(ckpt)
    assert newest.step == 4
    assert sorted(p.name for p in newest.path.iterdir()) == ["COMPLETE", "lightning.ckpt", "meta.json", "rank-0.pt"]
    meta = newest.meta()
    assert meta["step"] == 4 and meta["world_size"] == 1 and meta["job_id"] == "7"
    # everything loads with weights_only=True
    assert newest.rank_state(0)["data_sampler"] == {"pos": 3}
    assert "state_dict" in torch.load(newest.lightning_path, weights_only=True)
    assert not list(ckpt.glob(".step-*"))  # no temporaries left


def test_incomplete_directories_are_never_resumed_from(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _train_saving_each_step(ckpt, steps=2, keep_last=5)
    # a crash after the rename but before COMPLETE, and one in the middle of writing
    shutil.copytree(ckpt / "step-2", ckpt / "step-9")
    (ckpt / "step-9" / "COMPLETE").unlink()
    (ckpt / ".step-11.tmp").mkdir()
    (ckpt / "latest").write_text("step-9\n")  # even a pointer to it is not trusted
    assert newest_complete(ckpt).step == 2
    CheckpointManager(ckpt, keep_last=5, every_n_steps=1, parallelism=Parallelism.of("ddp", 1), identity={}).prune()
    assert not (ckpt / ".step-11.tmp").exists()
    assert (ckpt / "step-9").exists()  # newer than the newest complete one: left for inspection


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def _fake_complete(tmp_path, **meta):
    d = tmp_path / "checkpoints" / "step-10"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"format": 1, "step": 10, **meta}))
    (d / "COMPLETE").write_text("10\n")
    return newest_complete(tmp_path / "checkpoints")


def test_zero_checkpoint_on_another_world_size_loads_only_through_its_universal_form(tmp_path):
    ckpt = _fake_complete(tmp_path, strategy="deepspeed", zero_stage=3, world_size=16)
    with pytest.raises(CheckpointError) as e:
        check_compatible(ckpt, Parallelism.of("deepspeed", 8, zero_stage=2))
    msg = str(e.value)
    assert "ZeRO-3 on 16 ranks and this attempt runs deepspeed on 8" in msg
    assert "else through DeepSpeed's universal checkpoint, and converting it failed (no conversion was attempted)" in msg
    check_compatible(ckpt, Parallelism.of("deepspeed", 16, zero_stage=2))  # same size: fine
    universal = ckpt.path.parent / f"universal-{ckpt.path.name}"
    universal.mkdir()
    (universal / "COMPLETE").write_text("10\n")  # what lmtrain.checkpoint.elastic leaves when the conversion is done
    check_compatible(ckpt, Parallelism.of("deepspeed", 8, zero_stage=2))


def test_another_strategys_checkpoint_is_converted_except_into_zero(tmp_path):
    """DDP, FSDP2, TP and pipeline checkpoints resume under each other (lmtrain.checkpoint.cross_format),
    a ZeRO one through its universal form; ZeRO loads only its own."""
    fsdp = _fake_complete(tmp_path / "a", strategy="fsdp", zero_stage=None, world_size=2)
    check_compatible(fsdp, Parallelism.of("ddp", 2))
    check_compatible(fsdp, Parallelism.of("fsdp", 4, pipeline=2))
    with pytest.raises(CheckpointError, match="written with strategy fsdp and this attempt uses DeepSpeed ZeRO, which "
                                              "loads only its own checkpoints. Resume it with trainer.strategy ddp or fsdp"):
        check_compatible(fsdp, Parallelism.of("deepspeed", 2, zero_stage=2))
    zero = _fake_complete(tmp_path / "b", strategy="deepspeed", zero_stage=3, world_size=2)
    with pytest.raises(CheckpointError, match="this attempt runs ddp on 2: ZeRO partitions load only into ZeRO"):
        check_compatible(zero, Parallelism.of("ddp", 2))  # same world size, another strategy: the universal form
    universal = zero.path.parent / f"universal-{zero.path.name}"
    universal.mkdir()
    (universal / "COMPLETE").write_text("10\n")
    check_compatible(zero, Parallelism.of("ddp", 2))


def test_ddp_checkpoint_may_resume_on_another_world_size(tmp_path):
    ckpt = _fake_complete(tmp_path, strategy="ddp", zero_stage=None, world_size=2)
    check_compatible(ckpt, Parallelism.of("ddp", 4, zero_stage=2))
