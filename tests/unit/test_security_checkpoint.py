"""A checkpoint file that carries a code-executing pickle is refused (weights-only loading), and
nothing of it runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from lmtrain.checkpoint.manager import CompleteCheckpoint


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_in_a_rank_file_is_refused_and_never_runs(tmp_path):
    step = tmp_path / "checkpoints" / "step-5"
    step.mkdir(parents=True)
    marker = tmp_path / "pwned"
    with open(step / "rank-0.pt", "wb") as f:
        torch.save({"rng": _Exploit(str(marker)), "data_sampler": {}}, f)
    (step / "COMPLETE").write_text("5\n")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        CompleteCheckpoint(step=5, path=step).rank_state(0)
    assert not marker.exists()


def test_malicious_lightning_checkpoint_is_refused_by_the_resume_loader(tmp_path):
    # entry resumes with trainer.fit(ckpt_path=..., weights_only=True); Lightning's checkpoint
    # connector reads the file with this loader and that flag
    from lightning.fabric.utilities.cloud_io import _load as lightning_load

    path = tmp_path / "lightning.ckpt"
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "loops": _Exploit(str(marker))}, path)
    with pytest.raises(pickle.UnpicklingError):
        lightning_load(str(path), map_location="cpu", weights_only=True)
    assert not marker.exists()
