"""The DDP checkpoint file is written straight into lmtrain's ``.step-S.tmp`` directory: no
whole-checkpoint BytesIO, no temporary file in the system temp directory (Lightning's default
goes through both; on a cluster that is twice the checkpoint in RAM and a node-local /tmp that
must hold all of it)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lmtrain.distributed.strategies import DirectCheckpointIO, build_strategy, trainer_plugins


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
    from launcher.planning.resolve import resolve

    plan = resolve(str(repo / "jobs" / "tiny-cpu.yaml"), [], cluster="local",
                   environ={"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/h", "USER": "u"}).plan
    env = SimpleNamespace(rank=0, local_rank=0, node_rank=0, world_size=2, num_nodes=2, launcher="local",
                          master_addr="127.0.0.1", master_port=29500, nodes=("h",), job_id="j", restart_count=0)
    strategy = build_strategy(plan, env)
    assert isinstance(strategy.checkpoint_io, DirectCheckpointIO)
    assert trainer_plugins(strategy, env) == []  # DDP carries lmtrain's cluster environment itself


def test_one_process_runs_without_a_data_parallel_wrapper_and_writes_the_same_checkpoint(repo):
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from launcher.planning.resolve import resolve

    plan = resolve(str(repo / "jobs" / "tiny-cpu.yaml"), ["resources.nodes=1"], cluster="local",
                   environ={"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/h", "USER": "u"}).plan
    env = SimpleNamespace(rank=0, local_rank=0, node_rank=0, world_size=1, num_nodes=1, launcher="slurm",
                          master_addr="127.0.0.1", master_port=29500, nodes=("h",), job_id="j", restart_count=0)
    strategy = build_strategy(plan, env)
    assert type(strategy) is SingleDeviceStrategy and strategy.root_device == torch.device("cpu")
    assert isinstance(strategy.checkpoint_io, DirectCheckpointIO)
    (cluster,) = trainer_plugins(strategy, env)  # lmtrain's, so Lightning installs no requeue handlers
    assert isinstance(cluster, SLURMEnvironment) and not cluster.auto_requeue


def _same(a, b, where: str = "") -> list[str]:
    """Where two loaded checkpoint files differ (tensors by dtype, shape and value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):  # a loss scaler, say
        return _same(vars(a), vars(b), where)
    return [] if a == b else [where]


@pytest.mark.slow
def test_zero3_background_staging_writes_the_files_deepspeeds_own_save_writes(repo, runs_root):
    """The staging skips DeepSpeed's partition/re-gather round trip around a ZeRO-3 save (the
    persistent parameters' all-gathers held training) and saves the gathered parameters as the
    placeholders DeepSpeed would have saved: every file holds what DeepSpeed's own save of the same
    state holds, and the gathered parameters stay gathered."""
    import sys

    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch

    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"),
                             ["model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2",
                              "model.config.n_positions=32", "data.seq_len=32", "data.micro_batch_size=4",
                              "trainer.global_batch_size=8", "trainer.val_check_interval=null",
                              "trainer.strategy=deepspeed", "trainer.zero_stage=3"],
                             devices=2, max_steps=3, name="zero3-twice", environ=dict(os.environ),
                             say=lambda *_: None, resume=False)
    run_dir = Path(plan.paths.run_dir)
    helper = Path(__file__).with_name("_compare_zero_saves.py")
    out = run_dir / "launcher.out"
    assert launch(run_dir, 2, plan_env=plan.env, threads_per_proc=1, command=[sys.executable, "-u", str(helper), str(run_dir)],
                  out=open(out, "w")) == 0, out.read_text()[-3000:]
    facts = json.loads((run_dir / "cmp-facts.json").read_text())
    assert facts == {"gathered": facts["gathered"], "still_gathered": True} and facts["gathered"] > 0, facts
    ours = sorted(p.relative_to(run_dir / "cmp-staged") for p in (run_dir / "cmp-staged").rglob("*.pt"))
    theirs = sorted(p.relative_to(run_dir / "cmp-deepspeed") for p in (run_dir / "cmp-deepspeed").rglob("*.pt"))
    assert ours == theirs and len(ours) == 4, (ours, theirs)  # each rank: model states, optimizer states
    for rel in ours:
        a = torch.load(run_dir / "cmp-staged" / rel, map_location="cpu", weights_only=False)
        b = torch.load(run_dir / "cmp-deepspeed" / rel, map_location="cpu", weights_only=False)
        assert _same(a, b) == [], (rel, _same(a, b)[:5])
