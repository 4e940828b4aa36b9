"""data.sources: a weighted mixture of prepared stores (lmtrain.data.mixture).

- each virtual epoch takes each store's weight share of the samples, in an order fixed by the
  seed; a store smaller than its share is repeated (every window once before any twice), a larger
  one read a part per epoch, and the next epoch reads on where the last stopped;
- through the real entry on 2 ranks: a mixture run stopped at step 7 and resumed is bit-identical
  to the uninterrupted run (losses, gradient norms, weights), and one resumed on 1 rank continues
  its curve; the samples each step trained on come from the stores in the weights' proportions;
- stores tokenized differently, a weight <= 0, a store given twice: clear errors.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from launcher.submit.local_run import prepare_local_run
from lmcore.errors import SpecError
from lmtrain.checkpoint.manager import complete_checkpoints
from lmtrain.checkpoint.weights import lightning_state_dict
from lmtrain.data.loader import DataError, datasets, prepare
from lmtrain.data.mixture import MixtureWindows, shares
from tests.unit.test_checkpoint_resume import _launch, _ledger, _steps

REPO = Path(__file__).resolve().parents[2]


def test_shares_follow_the_weights_and_give_every_source_one():
    assert shares([1, 1], 10) == [5, 5]
    assert shares([3, 1], 100) == [75, 25]
    assert shares([1, 1, 1], 10) == [4, 3, 3]
    assert shares([1000, 1], 10) == [9, 1]
    assert sum(shares([0.2, 0.3, 0.5], 997)) == 997


class _Windows:
    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def keys(self, windows):
        assert 0 <= windows.min() and windows.max() < self.n
        return windows * 3 + 1  # a key other than the window number

    def at(self, key: int) -> tuple[str, int]:
        return self.name, (key - 1) // 3


def test_a_virtual_epoch_takes_each_share_and_small_sources_repeat_in_new_orders():
    mix = MixtureWindows([_Windows("big", 90), _Windows("small", 10)], [1, 1], seed=7)
    assert len(mix) == 100 and mix.counts == [50, 50]
    epoch0 = [mix[j] for j in range(100)]
    assert Counter(name for name, _ in epoch0) == {"big": 50, "small": 50}
    small = [i for name, i in epoch0 if name == "small"]
    for r in range(5):  # 10 windows, 5 passes: each pass is every window once, each pass its own order
        assert sorted(small[r * 10:(r + 1) * 10]) == list(range(10))
    assert small[:10] != small[10:20]
    big = [i for name, i in epoch0 if name == "big"] + [i for name, i in (mix[j] for j in range(100, 200))
                                                       if name == "big"]
    assert sorted(big[:90]) == list(range(90))  # the big store: all of it before any window again
    again = MixtureWindows([_Windows("big", 90), _Windows("small", 10)], [1, 1], seed=7)
    assert [again[j] for j in (0, 57, 99, 150, 12345)] == [mix[j] for j in (0, 57, 99, 150, 12345)]
    other = MixtureWindows([_Windows("big", 90), _Windows("small", 10)], [1, 1], seed=8)
    assert [other[j] for j in range(60, 100)] != [mix[j] for j in range(60, 100)]
    assert mix.epochs_of_each(1000) == pytest.approx([1000 * 0.5 / 90, 1000 * 0.5 / 10])


@pytest.mark.parametrize("sizes, weights", [((90, 10), (1, 1)), ((3, 500, 7), (1, 1, 100)), ((5, 2000), (0.9, 0.1)),
                                            ((1,), (1,))])
def test_each_sample_is_the_documented_window(sizes, weights):
    """Sample j is window perm_{s, q // n_s}[q mod n_s] of source s, q = epoch * c_s + k (the module's
    docstring): computed here sample by sample, against the per-epoch map the mixture builds."""
    mix = MixtureWindows([_Windows(str(i), n) for i, n in enumerate(sizes)], weights, seed=11)
    starts = [sum(mix.counts[:s]) for s in range(len(sizes))]

    def documented(j: int) -> tuple[str, int]:
        epoch, k = divmod(j, mix.total)
        s = max(i for i, st in enumerate(starts) if st <= k)
        q = epoch * mix.counts[s] + k - starts[s]
        r, w = divmod(q, sizes[s])
        g = torch.Generator().manual_seed((11 * 1_000_003 + s * 10_007 + r) % (2**63))
        return str(s), int(torch.randperm(sizes[s], generator=g)[w])

    picks = [*range(0, 3 * mix.total, 7), 10**6 + 3, 7 * mix.total + 1, 2 * mix.total + 5, 0]  # out of order too
    assert [mix[j] for j in picks] == [documented(j) for j in picks]
    assert mix.__getitems__(picks[:9]) == [mix[j] for j in picks[:9]]  # what the DataLoader fetches a batch by
    again = pickle.loads(pickle.dumps(mix))  # as DataLoader workers get it: the map is rebuilt there
    assert again.__getitems__(picks[::-1]) == [mix[j] for j in picks[::-1]]
    with pytest.raises(IndexError):
        mix[-1]


def test_a_store_part_keys_its_windows_by_their_first_token(stores):
    class Spec:
        path, sources, seq_len, val_fraction = str(stores[0]), None, 16, 0.1

    train, val = datasets(Spec(), seed=1)
    windows = np.array([0, 3, len(train) - 1])
    assert train.keys(windows).tolist() == [w * 16 for w in windows]
    assert val.keys(np.array([0])).tolist() == [len(train) * 16]  # validation windows follow the training ones
    assert all(torch.equal(train.at(k)["input_ids"], train[int(w)]["input_ids"]) for k, w in
               zip(train.keys(windows), windows))
    with pytest.raises(IndexError, match="out of range"):
        train.keys(np.array([len(train)]))


# --- through the real entry ---------------------------------------------------------------------
OVERRIDES = ["model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
             "data.seq_len=32", "data.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.log_every_n_steps=1",
             "trainer.val_check_interval=6", "trainer.limit_val_batches=2", "checkpoint.every_n_steps=5",
             "checkpoint.keep_last=2", "optim.warmup_steps=3", "model.config.resid_pdrop=0.0",
             "model.config.embd_pdrop=0.0", "model.config.attn_pdrop=0.0"]
MAX_STEPS = 12


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    """The shipped corpus as two stores: its license texts, and the Python documentation."""
    d = tmp_path_factory.mktemp("stores")
    corpus = REPO / "data" / "corpus"
    return (prepare([corpus / "licenses.jsonl"], d / "licenses").out,
            prepare([corpus / "python-docs.jsonl"], d / "docs").out)


def _spec(tmp_path: Path, stores: tuple[Path, Path], weights=(3, 1)) -> Path:
    spec = yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text())
    spec["data"].pop("path")
    spec["data"]["sources"] = [{"path": str(stores[0]), "weight": weights[0]},
                               {"path": str(stores[1]), "weight": weights[1]}]
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _plan(spec: Path, name: str, devices: int):
    return prepare_local_run(str(spec), OVERRIDES, devices=devices, max_steps=MAX_STEPS, name=name,
                             environ=dict(os.environ), say=lambda *_: None,
                             resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir())


@pytest.mark.slow
def test_a_mixture_run_resumes_bit_identically_and_on_another_world_size(runs_root, tmp_path, stores):
    spec = _spec(tmp_path, stores)
    straight = _plan(spec, "mix-straight", 2)
    assert _launch(straight, stop_at=0) == 0
    stopped = _plan(spec, "mix-stopped", 2)
    assert _launch(stopped, stop_at=7) == 0
    assert _ledger(stopped.paths.run_dir)[-1]["end_step"] == 7
    assert _launch(_plan(spec, "mix-stopped", 2), stop_at=0) == 0
    ref = _steps(straight.paths.run_dir)
    assert sorted(ref) == list(range(1, MAX_STEPS + 1))
    assert _steps(stopped.paths.run_dir) == ref  # losses and gradient norms, bit for bit
    a = lightning_state_dict(complete_checkpoints(Path(straight.paths.checkpoint_dir))[-1].path)
    b = lightning_state_dict(complete_checkpoints(Path(stopped.paths.checkpoint_dir))[-1].path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    elastic = _plan(spec, "mix-elastic", 2)
    assert _launch(elastic, stop_at=7) == 0
    assert _launch(_plan(spec, "mix-elastic", 1), stop_at=0) == 0  # the same samples, on one rank
    got = _steps(elastic.paths.run_dir)
    for step in range(8, MAX_STEPS + 1):
        assert got[step][0] == pytest.approx(ref[step][0], rel=1e-4), (step, got[step], ref[step])


def test_the_samples_come_from_the_stores_in_the_weights_proportions(stores):
    class Spec:
        sources = [type("S", (), {"path": str(stores[0]), "weight": 3.0})(),
                   type("S", (), {"path": str(stores[1]), "weight": 1.0})()]
        seq_len, val_fraction = 32, 0.02

    train, val = datasets(Spec(), seed=1)
    assert isinstance(train, MixtureWindows)
    first = Counter(train.source(j) for j in range(len(train)))
    assert first[0] / len(train) == pytest.approx(0.75, abs=1e-3), first
    assert len(val) > 0


def test_bad_mixtures_are_clear_errors(tmp_path, stores):
    from launcher.planning.resolve import resolve

    spec = _spec(tmp_path, stores, weights=(1, 0))
    with pytest.raises(SpecError, match=r"data\.sources\[1\]\.weight \(line \d+\): Input should be greater than 0"):
        resolve(str(spec), [], environ=dict(os.environ))
    spec = _spec(tmp_path, stores)
    with pytest.raises(SpecError, match=r"set exactly one of data\.path .* or data\.sources"):
        resolve(str(spec), [f"data.path={stores[0]}"], environ=dict(os.environ))
    both = yaml.safe_load(spec.read_text())
    both["data"]["sources"][1]["path"] = str(stores[0])
    spec.write_text(yaml.safe_dump(both))
    with pytest.raises(SpecError, match=r"data\.sources lists .*licenses more than once"):
        resolve(str(spec), [], environ=dict(os.environ))
    bytes_store = stores[0]
    tok = tmp_path / "tok"
    from lmtrain.data.prepare.tokenizer_train import train_tokenizer

    train_tokenizer([REPO / "data" / "corpus" / "licenses.jsonl"], tok, vocab_size=300)
    other = prepare([REPO / "data" / "corpus" / "licenses.jsonl"], tmp_path / "bpe", tokenizer=tok).out

    class Spec:
        sources = [type("S", (), {"path": str(bytes_store), "weight": 1.0})(),
                   type("S", (), {"path": str(other), "weight": 1.0})()]
        seq_len, val_fraction = 32, 0.02

    with pytest.raises(DataError, match=r"bpe was tokenized with huggingface \(vocab_size 300, eos 0\) but .*licenses "
                                        r"with bytes .*must share one tokenizer"):
        datasets(Spec(), seed=1)
    assert json.loads((other / "meta.json").read_text())["vocab_size"] == 300


def test_validate_names_a_store_whose_vocabulary_the_model_cannot_hold(tmp_path, stores):
    """Before anything is queued: a store tokenized with more ids than the model's embedding is
    refused, naming the source, its line and what to set; one with fewer is a plan note."""
    from launcher.planning.resolve import resolve
    from lmtrain.data.prepare.tokenizer_train import train_tokenizer

    train_tokenizer([REPO / "data" / "corpus" / "licenses.jsonl"], tmp_path / "tok", vocab_size=300)
    bpe = prepare([REPO / "data" / "corpus" / "licenses.jsonl"], tmp_path / "bpe", tokenizer=tmp_path / "tok").out
    spec = _spec(tmp_path, (stores[0], bpe))
    with pytest.raises(SpecError, match=r"line \d+: data\.sources\[1\] \S*bpe: tokenized with vocab_size 300 "
                                        r"\(huggingface tokenizer\), but the model has vocab_size 260: ids >= 260 "
                                        r"would index past its embedding; set model.config.vocab_size: 300"):
        resolve(str(spec), [], environ=dict(os.environ))
    with pytest.raises(SpecError, match=r"data\.sources\[1\] \S*bpe: tokenized with huggingface \(vocab_size 300, "
                                        r"eos 0\), but data\.sources\[0\] \S*licenses with bytes \(vocab_size 260, "
                                        r"eos 256\): the stores of a mixture must share one tokenizer"):
        resolve(str(spec), ["model.config.vocab_size=320"], environ=dict(os.environ))
    other = prepare([REPO / "data" / "corpus" / "python-docs.jsonl"], tmp_path / "bpe2", tokenizer=tmp_path / "tok").out
    plan = resolve(str(_spec(tmp_path, (bpe, other))), ["model.config.vocab_size=320"], environ=dict(os.environ)).plan
    assert any("data.sources[0]" in n and "vocab_size 300 (huggingface tokenizer), the model has 320: 20 rows" in n
               for n in plan.notes), plan.notes
    eos = [n for n in plan.notes if "eos" in n]  # tiny-cpu's GPT-2 ends documents with 256, the BPE store with 0
    assert eos == [f"data.sources[0] {bpe}: its documents end with id 0 (the tokenizer's eos), but the model has "
                   "eos_token_id 256: it learns to end a document with an id its generation does not stop at; set "
                   "model.config.eos_token_id: 0"], plan.notes
    plan = resolve(str(_spec(tmp_path, (bpe, other))), ["model.config.vocab_size=320", "model.config.eos_token_id=0"],
                   environ=dict(os.environ)).plan
    assert not [n for n in plan.notes if "eos" in n], plan.notes
    plan = resolve(str(_spec(tmp_path, stores)), [], environ=dict(os.environ)).plan  # bytes: eos 256 as the model's
    assert not [n for n in plan.notes if "eos" in n], plan.notes
