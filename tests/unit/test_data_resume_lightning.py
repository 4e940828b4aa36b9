"""The sampler contract under a real Lightning Trainer: advance() per micro-batch in
training_step, state in on_save_checkpoint / on_load_checkpoint, prefetching workers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch

from lmtrain.data.loader import make_dataloaders, prepare


class _Recorder(L.LightningModule):
    """A tiny LM that records the sample ids it trains on, and uses the sampler as documented."""

    def __init__(self, sampler) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(260, 8)
        self.head = torch.nn.Linear(8, 260)
        self.sampler = sampler
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.sampler.advance()
        self.seen.append([int(bytes(r[:7].tolist()).decode()) for r in batch["input_ids"]])
        logits = self.head(self.emb(batch["input_ids"]))  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def on_save_checkpoint(self, checkpoint):
        checkpoint["data_sampler"] = self.sampler.state_dict()

    def on_load_checkpoint(self, checkpoint):
        self.sampler.load_state_dict(checkpoint["data_sampler"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(data: Path, ckpt_dir: Path, max_steps: int, resume: Path | None = None) -> list[list[int]]:
    spec = SimpleNamespace(path=str(data), seq_len=8, micro_batch_size=2, num_workers=2, val_fraction=0.0)
    train, _, sampler = make_dataloaders(spec, world_size=1, rank=0, seed=9)
    module = _Recorder(sampler)
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[
            L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1)
        ],
    )
    trainer.fit(module, train, ckpt_path=str(resume) if resume else None)
    return module.seen


def test_lightning_resume_trains_on_exactly_the_uninterrupted_samples(tmp_path):
    text = "".join(f"{i:07d} " for i in range(40))
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    prepare([tmp_path / "n.jsonl"], tmp_path / "data")
    # 40 windows, 2 per micro-batch, 2 micro-batches per step: 10 steps per epoch; 12 crosses it.
    straight = _fit(tmp_path / "data", tmp_path / "a", max_steps=12)
    ckpt = next((tmp_path / "a").glob("*step=4.ckpt"))
    resumed = _fit(tmp_path / "data", tmp_path / "b", max_steps=12, resume=ckpt)
    assert len(straight) == 24 and len(resumed) == 16
    assert resumed == straight[8:]
    assert sorted(i for b in straight[:20] for i in b) == list(range(40))  # one whole epoch
