"""Training data on the allocation: token windows, a resumable distributed sampler, loaders.

The data a job trains on is a directory made by ``lmlaunch data prepare`` (format in
:mod:`lmtrain.data.prepare.build`). It is cut into non-overlapping windows of ``seq_len`` tokens; the
last ``val_fraction`` of the windows is the validation split.

How the runtime uses this module (lmtrain.task.entry and lmtrain.model.module)::

    train_loader, val_loader, sampler = make_dataloaders(
        spec.data, world_size=W, rank=R, seed=plan.training.seed)

    # 1. Per MICRO-batch the training loop actually consumes, exactly once, on every rank:
    #        sampler.advance()          (LMModule.training_step, first thing)
    #    Not in a callback's on_train_batch_end: a checkpoint callback may save before it.
    #    DataLoader workers prefetch ahead of the loop; advance() counts what the loop
    #    consumed, so the saved position is exactly the first sample not yet trained on.
    # 2. Saved in every rank's own file of a checkpoint (rank-R.pt, beside Lightning's state):
    #        {"data_sampler": sampler.state_dict(), ...}   (lmtrain.checkpoint.callback.CheckpointCallback)
    # 3. On resume, before the Trainer first iterates the train loader (the entry, before fit):
    #        sampler.load_state_dict(rank_state["data_sampler"])
    #    A different world_size or micro batch size re-shards from the saved global position.
    #    sampler.resharded_from is then (old world_size, old micro batch), else None: log it.
    # 4. Lightning: Trainer(use_distributed_sampler=False) (the plan's TrainerPlan) so it does not
    #    replace the sampler. The train loader is infinite (no __len__): bound training by
    #    max_steps and use an integer val_check_interval.
    # 5. The model must hold every id: TokenData(spec.data.path).check_vocab(config.vocab_size)
    #    (the loaders' datasets carry the same metadata: train_loader.dataset.meta).

tests/unit/test_data_resume_lightning.py runs exactly this under a Lightning Trainer with
prefetching workers and checks the resumed run trains on the uninterrupted run's samples.

The sampler is infinite over epochs: epoch ``e`` is a permutation of all windows from
``seed + e``. In each step every rank takes its own consecutive slice of ``batch_size_per_rank``
samples from the global order (rank r: positions ``g + r*B .. g + (r+1)*B`` where ``g`` is the
global position), so ranks never overlap, their union is the epoch (minus the remainder that
does not fill one whole step when ``drop_last``), and the state is one global position that
re-shards to any world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler

from lmcore.run.token_meta import tokenized_with, tokenizer_identity
from lmtrain.data.mixture import MixtureWindows
from lmtrain.data.prepare.build import (  # re-exported: the data API lives here
    DataError,
    PrepareResult,
    TokenMeta,
    prepare,
    read_meta,
    shipped_corpus_files,
)
from lmtrain.data.prepare.token_store import TokenStream
from lmtrain.data.prepare.tokenizer import BYTE_EOS_ID, BYTE_VOCAB_SIZE, ByteTokenizer, load_tokenizer

__all__ = [
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "ByteTokenizer",
    "DataError",
    "EvalShardSampler",
    "PrepareResult",
    "ResumableDistributedSampler",
    "TokenData",
    "TokenMeta",
    "TokenWindows",
    "load_tokenizer",
    "make_dataloaders",
    "prepare",
    "read_meta",
    "shipped_corpus_files",
]


class TokenWindows(Dataset):
    """Map-style dataset: sample ``i`` is window ``start + i`` of ``seq_len`` tokens of the
    store's token stream (lmtrain.data.prepare.token_store.TokenStream: its shards as one array; a window may
    span two shards, as it may span two documents).

    Items are ``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}`` with
    labels equal to input_ids (the model shifts them). The shards' memmaps are opened lazily in
    each process, so pickling the dataset to DataLoader workers never copies the tokens.
    """

    def __init__(self, stream: TokenStream, seq_len: int, start: int, count: int) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.start = start
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} out of range for {self.count} windows")
        return self.at((self.start + i) * self.seq_len)

    def keys(self, windows: np.ndarray) -> np.ndarray:
        """The first token of each of ``windows`` (window numbers), the key ``at`` reads a
        sample by (lmtrain.data.mixture reads its stores so)."""
        if len(windows) and not (0 <= windows.min() and windows.max() < self.count):
            raise IndexError(f"windows {windows.min()}..{windows.max()} out of range for {self.count}")
        return (self.start + windows.astype(np.int64)) * self.seq_len

    def at(self, lo: int) -> dict[str, torch.Tensor]:
        """The sample whose window starts at token ``lo``."""
        window = torch.from_numpy(self.stream.read(lo, self.seq_len).astype(np.int64))  # (T,)
        return {"input_ids": window, "labels": window}


class TokenData:
    """A prepared data directory: validated metadata and its shards as one token stream."""

    def __init__(self, path: str | Path, *, verify_checksum: bool = False) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path, verify_checksum=verify_checksum)
        self.stream = TokenStream(self.path, [(s["file"], int(s["tokens"])) for s in self.meta.shards],
                                  self.meta.np_dtype)

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    def __len__(self) -> int:
        return self.meta.num_tokens

    def tokens(self) -> np.ndarray:
        """Every token, read into memory (for tests and small data; training reads windows)."""
        return self.stream.read(0, self.meta.num_tokens)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise DataError when the model's embedding cannot hold every id in the data."""
        if model_vocab_size < self.meta.vocab_size:
            raise DataError(
                f"model vocab_size({model_vocab_size}) < data vocab_size({self.meta.vocab_size}) of "
                f"{self.path} (tokenizer {self.meta.tokenizer.get('kind', '?')}); set "
                f"model.config.vocab_size >= {self.meta.vocab_size}"
            )

    def split(self, seq_len: int, val_fraction: float) -> tuple[TokenWindows, TokenWindows]:
        """(train, val) over non-overlapping windows; val is the last ``val_fraction`` of them.

        With ``val_fraction > 0`` validation gets at least one window; with 0 it is empty.
        """
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        n = self.meta.num_tokens // seq_len
        n_val = math.ceil(n * val_fraction) if val_fraction > 0 else 0
        n_train = n - n_val
        if n_train < 1:
            raise DataError(
                f"{self.path}: num_tokens({self.meta.num_tokens}) // seq_len({seq_len}) = {n} windows, "
                f"{n_val} of them for validation (val_fraction {val_fraction}), leaving {n_train} "
                "to train on; use more text, a shorter data.seq_len or a smaller data.val_fraction"
            )
        train = TokenWindows(self.stream, seq_len, 0, n_train)
        val = TokenWindows(self.stream, seq_len, n_train, n_val)
        return train, val


class ResumableDistributedSampler(Sampler[int]):
    """Infinite, seeded, rank-sharded sample order whose consumed position can be saved.

    Parameters
    ----------
    dataset_len:
        Number of samples (windows) in the training set.
    world_size, rank:
        Data-parallel size and this process's rank in it.
    seed:
        Epoch ``e`` visits the samples in ``randperm(dataset_len)`` seeded with ``seed + e``.
    batch_size_per_rank:
        The DataLoader's batch size (the micro batch). One global step takes
        ``world_size * batch_size_per_rank`` consecutive positions of the epoch's order.
    drop_last:
        True: the tail of an epoch that does not fill a whole global step is skipped (it is
        a different tail every epoch). False: the last step wraps around to the start of the
        epoch's order so every sample is seen each epoch (a few twice).

    The iterator never ends; ``advance`` (called by the training loop per consumed micro-batch)
    moves the saved position, independent of how far DataLoader workers prefetched.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        dataset_len: int,
        *,
        world_size: int,
        rank: int,
        seed: int,
        batch_size_per_rank: int,
        drop_last: bool = True,
        epoch_offsets: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank({rank}) must be in [0, world_size({world_size}))")
        if batch_size_per_rank < 1:
            raise ValueError(f"batch_size_per_rank must be >= 1, got {batch_size_per_rank}")
        step = world_size * batch_size_per_rank
        if dataset_len < (step if drop_last else 1):
            raise DataError(
                f"the training set has {dataset_len} samples, fewer than one global step of "
                f"world_size({world_size}) x micro_batch_size({batch_size_per_rank}) = {step}; "
                "use more data, a shorter data.seq_len or a smaller batch"
            )
        self.dataset_len = dataset_len
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.batch_size_per_rank = batch_size_per_rank
        self.drop_last = drop_last
        # yield epoch * dataset_len + id: a dataset whose samples differ per epoch (lmtrain.data.mixture)
        self.epoch_offsets = epoch_offsets
        # The consumed position: epoch, and samples consumed in it by all ranks together.
        self.epoch = 0
        self.global_position = 0
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        # (world_size, batch_size_per_rank) of the state loaded, when it differed from ours.
        self.resharded_from: tuple[int, int] | None = None

    # -- the order -------------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size_per_rank

    def permutation(self, epoch: int) -> torch.Tensor:
        """The global order of epoch ``epoch`` (int64 tensor of all sample ids; with
        ``epoch_offsets``, each plus ``epoch * dataset_len``)."""
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(self.dataset_len, generator=g)
            # ids of the epoch's samples: with epoch_offsets, added here once rather than per batch
            self._perm_cache = (epoch, perm + epoch * self.dataset_len if self.epoch_offsets else perm)
        return self._perm_cache[1]

    def _normalize(self, epoch: int, pos: int) -> tuple[int, int]:
        """Roll over to the next epoch when no further step fits in this one."""
        if self.drop_last:
            if pos + self.global_batch > self.dataset_len:
                return epoch + 1, 0
        elif pos >= self.dataset_len:
            return epoch + 1, 0
        return epoch, pos

    def _rank_batch(self, epoch: int, pos: int) -> list[int]:
        perm = self.permutation(epoch)
        lo = pos + self.rank * self.batch_size_per_rank
        idx = torch.arange(lo, lo + self.batch_size_per_rank) % self.dataset_len
        return perm[idx].tolist()

    def __iter__(self) -> Iterator[int]:
        # Snapshot the consumed position now: an iterator created after load_state_dict
        # starts where the checkpoint stopped.
        return self._iterate(self.epoch, self.global_position)

    def _iterate(self, epoch: int, pos: int) -> Iterator[int]:
        while True:
            epoch, pos = self._normalize(epoch, pos)
            yield from self._rank_batch(epoch, pos)
            pos += self.global_batch

    def epoch_indices(self, epoch: int) -> list[int]:
        """Every sample id this rank gets in ``epoch`` (from its start), in order."""
        out: list[int] = []
        e, pos = self._normalize(epoch, 0)
        while e == epoch:
            out.extend(self._rank_batch(e, pos))
            e, pos = self._normalize(e, pos + self.global_batch)
        return out

    # -- the consumed position -------------------------------------------------------------

    def advance(self, n_samples: int | None = None) -> None:
        """Record that the training loop consumed ``n_samples`` (default: one micro-batch) on
        this rank; every rank does the same in lockstep, so the global position moves by
        ``n_samples * world_size``. Must be a whole number of micro-batches."""
        n = self.batch_size_per_rank if n_samples is None else int(n_samples)
        if n < 0 or n % self.batch_size_per_rank:
            raise ValueError(
                f"advance({n}): must be a non-negative multiple of batch_size_per_rank({self.batch_size_per_rank})"
            )
        epoch, pos = self.epoch, self.global_position
        for _ in range(n // self.batch_size_per_rank):
            epoch, pos = self._normalize(epoch, pos)
            pos += self.global_batch
        self.epoch, self.global_position = self._normalize(epoch, pos)

    @property
    def index(self) -> int:
        """Samples this rank consumed in the current epoch."""
        return self.global_position // self.world_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "global_position": self.global_position,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size_per_rank": self.batch_size_per_rank,
            "dataset_len": self.dataset_len,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. A different world_size or micro batch size re-shards from
        the saved global position; a different seed or dataset size is an error (the order
        would not be the same order)."""
        missing = [k for k in ("epoch", "seed", "world_size") if k not in state]
        if missing:
            raise DataError(
                f"sampler state lacks {missing}; it was not written by ResumableDistributedSampler"
            )
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"the checkpoint's data order was seeded with {state['seed']}, this run with "
                f"trainer.seed({self.seed}); resume with trainer.seed: {state['seed']} or start a new run"
            )
        saved_len = state.get("dataset_len")
        if saved_len is not None and int(saved_len) != self.dataset_len:
            raise DataError(
                f"the checkpoint was trained on {saved_len} training samples, this run has "
                f"{self.dataset_len}: the data, data.seq_len or data.val_fraction changed; "
                "resume with the same data or start a new run"
            )
        if "global_position" in state:
            pos = int(state["global_position"])
        else:  # a per-rank index alone: only meaningful at the same world size
            pos = int(state["index"]) * int(state["world_size"])
        if pos < 0 or int(state["epoch"]) < 0:
            raise DataError(f"sampler state has a negative position: {state}")
        self.epoch, self.global_position = self._normalize(int(state["epoch"]), pos)
        self.resharded_from = (
            (int(state["world_size"]), int(state.get("batch_size_per_rank", self.batch_size_per_rank)))
            if int(state["world_size"]) != self.world_size
            or int(state.get("batch_size_per_rank", self.batch_size_per_rank)) != self.batch_size_per_rank
            else None
        )


class EvalShardSampler(Sampler[int]):
    """Validation order: sequential, rank-strided, the same number of samples on every rank
    (the last few wrap to the start) so no rank waits on a collective the others skipped."""

    def __init__(self, dataset_len: int, *, world_size: int, rank: int) -> None:
        self.dataset_len = dataset_len
        self.world_size = world_size
        self.rank = rank
        self.per_rank = math.ceil(dataset_len / world_size) if dataset_len else 0

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        for k in range(self.per_rank):
            yield (self.rank + k * self.world_size) % self.dataset_len


def datasets(data_spec: Any, seed: int) -> tuple[Any, Any]:
    """(train, validation) datasets of ``data_spec``: one store's windows, or the mixture of
    ``data_spec.sources`` (lmtrain.data.mixture) and their validation windows one after another."""
    sources = getattr(data_spec, "sources", None)
    if not sources:
        return TokenData(data_spec.path).split(data_spec.seq_len, data_spec.val_fraction)
    splits = [TokenData(src.path).split(data_spec.seq_len, data_spec.val_fraction) for src in sources]
    check_same_tokens([src.path for src in sources])
    train = MixtureWindows([t for t, _ in splits], [src.weight for src in sources], seed,
                           names=[str(src.path) for src in sources])
    return train, ConcatDataset([v for _, v in splits])


def check_same_tokens(paths: list[str]) -> None:
    """Every store of a mixture was tokenized alike (lmcore.run.token_meta: vocabulary, eos,
    tokenizer): DataError naming the first that differs from the first store."""
    metas = [read_meta(p).to_json() for p in paths]
    for path, m in zip(paths[1:], metas[1:]):
        if tokenizer_identity(m) != tokenizer_identity(metas[0]):
            raise DataError(
                f"data.sources: {path} was tokenized with {tokenized_with(m)} but {paths[0]} with "
                f"{tokenized_with(metas[0])}: the stores of a mixture must share one tokenizer")


def make_dataloaders(
    data_spec: Any,
    *,
    world_size: int,
    rank: int,
    seed: int,
    pin_memory: bool | None = None,
    drop_last: bool = True,
    prefetch_factor: int | None = None,
    val_drop_last: bool = False,
) -> tuple[DataLoader, DataLoader | None, ResumableDistributedSampler]:
    """Train loader (infinite, resumable), validation loader (None when val_fraction is 0
    or there are no validation windows) and the train sampler, for one rank.

    ``data_spec`` is a ``lmcore.job.spec.DataSpec`` (or anything with ``path``, ``seq_len``,
    ``micro_batch_size``, ``num_workers`` and ``val_fraction``). ``pin_memory`` defaults to
    whether CUDA is available; workers persist across iterations when there are any.
    """
    train_ds, val_ds = datasets(data_spec, seed)
    mbs = int(data_spec.micro_batch_size)
    sampler = ResumableDistributedSampler(
        len(train_ds),
        world_size=world_size,
        rank=rank,
        seed=seed,
        batch_size_per_rank=mbs,
        drop_last=drop_last,
        epoch_offsets=isinstance(train_ds, MixtureWindows),
    )
    workers = int(data_spec.num_workers)
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    extra: dict[str, Any] = {}
    if workers > 0:
        extra["persistent_workers"] = True
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    # batch_size is always an int: DeepSpeed's Lightning strategy reads it off the loader.
    train_loader = DataLoader(
        train_ds,
        batch_size=mbs,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin,
        **extra,
    )
    val_loader = None
    if len(val_ds) > 0:
        val_loader = DataLoader(
            val_ds,
            batch_size=mbs,
            sampler=EvalShardSampler(len(val_ds), world_size=world_size, rank=rank),
            drop_last=val_drop_last,  # a pipeline's schedule splits only whole batches
            num_workers=workers,
            pin_memory=pin,
            **extra,
        )
    return train_loader, val_loader, sampler
