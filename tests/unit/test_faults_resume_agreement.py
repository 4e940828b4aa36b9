"""Every rank resumes from the checkpoint rank 0 chose (published in the rendezvous), not from
its own listing of a shared filesystem, and waits a bounded time for it to look complete."""

from __future__ import annotations

import threading
import time

import pytest

from lmtrain.checkpoint.manager import CheckpointError, newest_complete
from lmtrain.checkpoint.resume_point import agreed_checkpoint
from lmtrain.distributed.task_env import TaskEnv, rendezvous


def _env(rank: int) -> TaskEnv:
    return TaskEnv(launcher="local", rank=rank, local_rank=rank, node_rank=0, world_size=2, num_nodes=1,
                   job_id="77", restart_count=0, nodes=("n1",))


def _complete(ckpts, step: int) -> None:
    d = ckpts / f"step-{step}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text(f"{step}\n")


def test_other_ranks_resume_from_rank_zeros_choice_even_when_a_newer_checkpoint_appears(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    ckpts = tmp_path / "checkpoints"
    _complete(ckpts, 5)
    chosen = newest_complete(ckpts).path.name
    rendezvous(_env(0), tmp_path, attempt=2, resume=chosen)
    _complete(ckpts, 10)  # finished by a straggler writer after rank 0 decided
    rv1 = rendezvous(_env(1), tmp_path, attempt=None, timeout_s=5)
    assert (rv1.attempt, rv1.resume) == (2, "step-5")
    assert agreed_checkpoint(ckpts, rv1.resume).step == 5
    assert newest_complete(ckpts).step == 10  # what rank 1 would have picked on its own


def test_a_fresh_start_is_agreed_too(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    rendezvous(_env(0), tmp_path, attempt=1, resume=None)
    (tmp_path / "checkpoints").mkdir()
    _complete(tmp_path / "checkpoints", 3)
    rv1 = rendezvous(_env(1), tmp_path, attempt=None, timeout_s=5)
    assert rv1.resume is None and agreed_checkpoint(tmp_path / "checkpoints", rv1.resume) is None


def test_agreed_checkpoint_waits_for_a_lagging_view_then_gives_a_clear_error(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step-8").mkdir(parents=True)
    later = threading.Timer(0.7, lambda: (ckpts / "step-8" / "COMPLETE").write_text("8\n"))
    later.start()
    t0 = time.monotonic()
    assert agreed_checkpoint(ckpts, "step-8", wait_s=10).step == 8
    assert 0.5 < time.monotonic() - t0 < 5
    with pytest.raises(CheckpointError, match=r"does not see it complete after 1 s: is .* shares"):
        agreed_checkpoint(ckpts, "step-9", wait_s=1)
    with pytest.raises(CheckpointError, match="not a step-<S> directory"):
        agreed_checkpoint(ckpts, "../elsewhere", wait_s=1)
