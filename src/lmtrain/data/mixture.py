"""A weighted mixture of prepared stores (``data.sources``) as one map-style dataset whose sample
order is a pure function of the sample's index and the seed, so the resumable sampler's saved
position (lmtrain.data.loader.ResumableDistributedSampler) continues the exact sample sequence after a
resume, on any world size.

The mixture has "virtual epochs" of ``V`` samples, V the number of training windows of all
sources together. Each virtual epoch takes ``c_s`` samples from source ``s``: its weight's share
of V (largest remainders, at least one each). The sampler shuffles the V positions of each
virtual epoch and yields ``epoch * V + position``; position ``k`` in source s's block is that
source's sample number ``q = epoch * c_s + k`` overall, i.e. window ``perm_{s,r}[q mod n_s]`` of
its own epoch ``r = q // n_s`` (n_s: its windows; perm: a permutation seeded by the seed, the
source and r). A source whose share exceeds its size is repeated, each repetition in a new order;
one whose share is smaller is read a part per virtual epoch, and every window before any twice.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

PERMUTATIONS_KEPT = 2  # per source: the current epoch's order and the next one's


def shares(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders), each share >= 1."""
    if total < len(weights):
        raise ValueError(f"{total} samples cannot be shared among {len(weights)} sources")
    norm = sum(weights)
    exact = [w / norm * (total - len(weights)) for w in weights]
    out = [1 + math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


class MixtureWindows(Dataset):
    """Samples of ``parts`` (each a source's training windows) mixed by ``weights``; index ``j``
    is position ``j % V`` of virtual epoch ``j // V`` (see the module docstring).

    A part has ``len()`` windows, ``keys(windows)`` (an int64 array: where each window number is,
    lmtrain.data.loader.TokenWindows: its first token) and ``at(key)`` (the sample there)."""

    def __init__(self, parts: Sequence[Any], weights: Sequence[float], seed: int, names: Sequence[str] = ()) -> None:
        self.parts = list(parts)
        self.sizes = [len(p) for p in self.parts]
        if any(n < 1 for n in self.sizes):
            empty = [names[i] if i < len(names) else str(i) for i, n in enumerate(self.sizes) if n < 1]
            raise ValueError(f"data.sources {', '.join(empty)}: no training windows")
        self.total = sum(self.sizes)
        self.counts = shares(weights, self.total)
        self.starts = [0]
        for c in self.counts:
            self.starts.append(self.starts[-1] + c)
        self.starts.pop()  # each source's first position in a virtual epoch
        self.seed = seed
        self.names = list(names)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._map_epoch = -1  # the virtual epoch whose positions _map_source/_map_key hold
        self._map_source = array("h")
        self._map_key = array("q")
        self._readers = [p.at for p in self.parts]  # each part's ``at``, bound once

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, j: int) -> Any:
        return self.__getitems__([j])[0]

    def source(self, j: int) -> int:
        """Which source mixture sample ``j`` is read from."""
        epoch, k = divmod(int(j), self.total)
        if epoch != self._map_epoch:
            self._build_map(epoch)
        return self._map_source[k]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch of samples (torch's DataLoader fetches a batch through this when it is there).
        Per sample: its position's source and key, then that part's ``at(key)``; this loop is all
        a mixture adds to reading one store (bench/data_prepare.py measures it)."""
        readers, total, out = self._readers, self.total, []
        base, sources, keys = self._map_epoch * total, self._map_source, self._map_key
        for j in indices:
            k = j - base
            if not 0 <= k < total:
                self._build_map(int(j) // total)
                base, sources, keys = self._map_epoch * total, self._map_source, self._map_key
                k = j - base
            out.append(readers[sources[k]](keys[k]))
        return out

    def _build_map(self, epoch: int) -> None:
        """Each position's source and window key in virtual epoch ``epoch``, computed at once
        (numpy) rather than per sample: position k of source s's block is its sample
        q = epoch * c_s + k, window perm_{s, q // n_s}[q mod n_s]; its key is the part's
        ``keys()`` of that window."""
        if epoch < 0:
            raise IndexError(f"mixture sample of virtual epoch {epoch}: indices are >= 0")
        source = np.empty(self.total, dtype=np.int16)  # data.sources holds at most 64
        key = np.empty(self.total, dtype=np.int64)
        for s, (c, n, start) in enumerate(zip(self.counts, self.sizes, self.starts)):
            q = epoch * c + np.arange(c, dtype=np.int64)
            r, w = np.divmod(q, n)
            for rr in range(int(r[0]), int(r[-1]) + 1):  # ascending: the permutation cache keeps the newest
                lo, hi = np.searchsorted(r, [rr, rr + 1])
                w[lo:hi] = self._perm(s, rr)[w[lo:hi]]
            key[start:start + c] = self.parts[s].keys(w)
            source[start:start + c] = s
        # array.array: indexing it gives a Python int in half the time ndarray.item() takes
        self._map_epoch, self._map_source, self._map_key = epoch, array("h", source.tobytes()), array("q", key.tobytes())

    def _perm(self, s: int, r: int) -> np.ndarray:
        key = (s, r)
        perm = self._perms.get(key)
        if perm is None:  # torch's seeded permutation, read through numpy (a scalar index costs ~0.1 us, not ~5)
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + s * 10_007 + r) % (2**63))
            perm = self._perms[key] = torch.randperm(self.sizes[s], generator=g).numpy()
            mine = sorted(k for k in self._perms if k[0] == s and k != key)
            for old in mine[: max(0, len(mine) + 1 - PERMUTATIONS_KEPT)]:
                del self._perms[old]
        return perm

    def epochs_of_each(self, samples: int) -> list[float]:
        """How many passes over each source ``samples`` training samples of the mixture make."""
        return [samples * c / self.total / n for c, n in zip(self.counts, self.sizes)]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_perms": {}, "_map_epoch": -1, "_map_source": array("h"),
                "_map_key": array("q")}
