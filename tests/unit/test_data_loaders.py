"""TokenData windows, the train/val split and make_dataloaders, with DataLoader workers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmtrain.data.loader import DataError, TokenData, make_dataloaders, prepare

SEQ = 8
N_WINDOWS = 100


@pytest.fixture(scope="module")
def numbered(tmp_path_factory) -> Path:
    """Prepared bytes where window i (seq_len 8) is the text f"{i:07d} ": ids decode to sample ids."""
    d = tmp_path_factory.mktemp("numbered")
    text = "".join(f"{i:07d} " for i in range(N_WINDOWS))
    (d / "numbers.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    prepare([d / "numbers.jsonl"], d / "prepared")
    return d / "prepared"


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(bytes(row[:7].tolist()).decode()) for row in batch["input_ids"]]


def spec(path: Path, **kw) -> SimpleNamespace:
    base = dict(path=str(path), seq_len=SEQ, micro_batch_size=3, num_workers=0, val_fraction=0.1)
    base.update(kw)
    return SimpleNamespace(**base)


def test_windows_are_consecutive_non_overlapping_token_slices(numbered):
    data = TokenData(numbered)
    train, val = data.split(SEQ, 0.1)
    assert (len(train), len(val)) == (90, 10)  # 801 tokens // 8 = 100 windows; the last 10% validate
    tokens = torch.from_numpy(data.tokens().astype("int64"))
    for i in (0, 1, 89):
        item = train[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (SEQ,)
        assert torch.equal(item["input_ids"], tokens[i * SEQ : (i + 1) * SEQ])
        assert torch.equal(item["labels"], item["input_ids"])
    assert bytes(val[0]["input_ids"][:7].tolist()).decode() == "0000090"
    with pytest.raises(IndexError):
        train[90]


def test_split_needs_at_least_one_training_window(numbered):
    data = TokenData(numbered)
    with pytest.raises(DataError, match=r"num_tokens\(801\) // seq_len\(1024\) = 0 windows"):
        data.split(1024, 0.1)
    assert len(data.split(SEQ, 0.0)[1]) == 0
    assert len(data.split(SEQ, 0.001)[1]) == 1  # any val_fraction > 0 validates on something


def test_check_vocab_names_the_model_key(numbered):
    TokenData(numbered).check_vocab(260)
    with pytest.raises(
        DataError, match=r"model vocab_size\(128\) < data vocab_size\(260\).*model\.config\.vocab_size >= 260"
    ):
        TokenData(numbered).check_vocab(128)


def test_dataloaders_use_the_micro_batch_and_cpu_settings(numbered):
    train, val, sampler = make_dataloaders(spec(numbered), world_size=1, rank=0, seed=0)
    assert train.batch_size == 3 and val.batch_size == 3 and train.sampler is sampler
    assert train.pin_memory is (torch.cuda.is_available())
    with pytest.raises(TypeError):
        len(train)  # infinite: Lightning trains it by max_steps
    batch = next(iter(train))
    assert batch["input_ids"].shape == (3, SEQ) and batch["labels"].shape == (3, SEQ)
    workers, _, _ = make_dataloaders(spec(numbered, num_workers=2), world_size=1, rank=0, seed=0)
    assert workers.num_workers == 2 and workers.persistent_workers
    assert make_dataloaders(spec(numbered, val_fraction=0.0), world_size=1, rank=0, seed=0)[1] is None


def test_validation_is_sharded_across_ranks_with_equal_counts(numbered):
    shards = []
    for rank in range(3):
        _, val, _ = make_dataloaders(spec(numbered), world_size=3, rank=rank, seed=0)
        shards.append([i for b in val for i in sample_ids(b)])
    assert [len(s) for s in shards] == [4, 4, 4]  # ceil(10 / 3): two wrap around
    assert set().union(*shards) == set(range(90, 100))
    assert shards[0][:3] == [90, 93, 96]


def test_train_ranks_see_disjoint_samples_through_the_loader(numbered):
    seen = []
    for rank in range(2):
        train, _, sampler = make_dataloaders(spec(numbered), world_size=2, rank=rank, seed=11)
        it = iter(train)
        ids = [i for _ in range(15) for i in sample_ids(next(it))]  # 90 // 6 = 15 steps: one epoch
        assert ids == sampler.epoch_indices(0)
        seen.append(ids)
    assert not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) == set(range(90))


def _train_ids(path: Path, rank: int, steps: int, workers: int, state=None):
    train, _, sampler = make_dataloaders(
        spec(path, num_workers=workers),
        world_size=2,
        rank=rank,
        seed=5,
        prefetch_factor=4 if workers else None,
    )
    if state is not None:
        sampler.load_state_dict(state)
    it = iter(train)
    out = []
    for _ in range(steps):
        out.append(sample_ids(next(it)))
        sampler.advance()  # the training loop consumed this micro-batch
    del it
    return out, sampler.state_dict()


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resume_matches_uninterrupted_order_despite_prefetch(numbered, workers):
    # 15 steps per epoch: stop mid-epoch at 9, resume and run past the epoch boundary to 24.
    rank = 1
    straight, _ = _train_ids(numbered, rank, 24, workers)
    head, state = _train_ids(numbered, rank, 9, workers)
    assert state["index"] == 9 * 3  # what was trained on, not what workers prefetched
    tail, end_state = _train_ids(numbered, rank, 15, workers, state=state)
    assert head + tail == straight
    assert (end_state["epoch"], end_state["index"]) == (1, 9 * 3)


def test_datasets_pickle_to_workers_without_their_tokens(numbered):
    import pickle

    train, _ = TokenData(numbered).split(SEQ, 0.1)
    train[0]  # opens the memmap in this process
    blob = pickle.dumps(train)
    assert len(blob) < 2000  # path and metadata only; each worker maps the file itself
    assert torch.equal(pickle.loads(blob)[5]["input_ids"], train[5]["input_ids"])
