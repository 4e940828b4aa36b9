"""The DDP checkpoint file is written straight into lmtrain's ``.step-S.tmp`` directory: no
whole-checkpoint BytesIO, no temporary file in the system temp directory (Lightning's default
goes through both; on a cluster that is twice the checkpoint in RAM and a node-local /tmp that
must hold all of it)."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lmtrain.strategies import DirectCheckpointIO, build_strategy


def _state() -> dict:
    return {"state_dict": {"w": torch.arange(250_000, dtype=torch.float32)}, "global_step": 7}


def test_the_file_goes_straight_to_its_place_without_the_temp_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))  # any detour through it fails
    target = tmp_path / "ckpts" / ".step-7.tmp" / "lightning.ckpt"
    with pytest.raises(OSError):
        TorchCheckpointIO().save_checkpoint(_state(), target)  # Lightning's way: BytesIO -> /tmp -> move
    DirectCheckpointIO().save_checkpoint(_state(), target)
    got = torch.load(target, weights_only=True)
    assert got["global_step"] == 7 and torch.equal(got["state_dict"]["w"], _state()["state_dict"]["w"])
    assert sorted(p.name for p in target.parent.iterdir()) == ["lightning.ckpt"]  # nothing else left beside it
    with pytest.raises(TypeError):
        DirectCheckpointIO().save_checkpoint(_state(), target, storage_options={"x": 1})


def test_the_ddp_strategy_uses_it(repo):
    from launcher.resolve import resolve

    plan = resolve(str(repo / "jobs" / "tiny-cpu.yaml"), [], cluster="local",
                   environ={"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/h", "USER": "u"}).plan
    env = SimpleNamespace(rank=0, local_rank=0, node_rank=0, world_size=2, num_nodes=2, launcher="local",
                          master_addr="127.0.0.1", master_port=29500, nodes=("h",), job_id="j", restart_count=0)
    strategy = build_strategy(plan, env)
    assert isinstance(strategy.checkpoint_io, DirectCheckpointIO)
