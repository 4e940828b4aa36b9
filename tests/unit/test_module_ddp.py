"""2-process DDP (gloo) computes the same first-step gradients as 1 process on the combined
batch: the sampler gives rank r positions [r*B, (r+1)*B) of the global order, and DDP averages
per-rank mean losses, which is the mean over the combined batch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from launcher.submit.local_run import prepare_local_run
from lmtrain.local.launch import launch

HELPER = Path(__file__).with_name("_dump_first_grads.py")
# Dropout off: each rank draws its own dropout masks, which one process cannot reproduce.
BASE = [
    "model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
    "model.config.resid_pdrop=0.0", "model.config.embd_pdrop=0.0", "model.config.attn_pdrop=0.0",
    "data.seq_len=32", "trainer.global_batch_size=8", "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0", "optim.warmup_steps=0",
]


def _grads(repo, name: str, devices: int, micro_batch: int) -> list[dict[str, torch.Tensor]]:
    plan = prepare_local_run(
        str(repo / "jobs" / "tiny-cpu.yaml"), [*BASE, f"data.micro_batch_size={micro_batch}"],
        devices=devices, max_steps=1, name=name, environ=dict(os.environ), say=lambda *_: None,
    )
    out = Path(plan.paths.run_dir) / "grads"
    code = launch(plan.paths.run_dir, devices, plan_env=plan.env, threads_per_proc=1,
                  command=[sys.executable, "-u", str(HELPER), plan.paths.run_dir, str(out)],
                  out=open(Path(plan.paths.run_dir) / "launcher.out", "w"))
    assert code == 0, (Path(plan.paths.run_dir) / "launcher.out").read_text()[-3000:]
    return [torch.load(out / f"rank-{r}.pt", weights_only=True) for r in range(devices)]


def test_two_process_ddp_first_step_gradients_equal_one_process_on_combined_batch(repo, runs_root):
    (single,) = _grads(repo, "grads-1", devices=1, micro_batch=8)
    r0, r1 = _grads(repo, "grads-2", devices=2, micro_batch=4)
    assert single.keys() == r0.keys() == r1.keys() and len(single) > 5
    for name in single:
        assert torch.equal(r0[name], r1[name]), f"{name}: DDP ranks disagree after all-reduce"
        assert torch.allclose(single[name], r0[name], rtol=1e-4, atol=1e-6), (
            f"{name}: max diff {(single[name] - r0[name]).abs().max().item():.3g}"
        )
    # not trivially equal: the gradient is really there
    assert sum(g.abs().sum().item() for g in single.values()) > 0
