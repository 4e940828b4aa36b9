"""The sharded token store: one shard of token ids per input file, each written atomically, and
the index (``meta.json``) that makes them one dataset. numpy only (no torch).

Layout of a prepared directory (format ``lmtrain-tokens`` version 2)::

    meta.json            the index: dtype, vocab_size, eos_id, tokenizer, totals, and per shard
                         its file, tokens, documents, sha256 and the input file it came from
    shards/00000.bin     input file 0's documents' ids, each document followed by eos (little-endian)
    shards/00000.json    the shard's own record, written after its .bin: a shard with a record
                         whose sizes and input checksum match is finished and never rewritten

A shard is written under a temporary name, fsynced and renamed, then its record is written the
same way, so a preparation killed at any moment leaves finished shards and at most one temporary
file; :func:`finished` tells which shards a new attempt can keep. :func:`assemble` writes the
index once every shard is finished. The shards are numbered by input file, so the same inputs give
the same shards (and the same bytes) whichever process or array task wrote each one.

``tokens_sha256`` of a version 2 index is the sha256 of the shards' sha256 digests in order (each
shard's own digest covers its bytes); version 1 (one ``tokens.bin``) is still read.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from itertools import accumulate, chain
from pathlib import Path
from typing import Any

import numpy as np

from lmcore.atomic import write_atomic
from lmtrain import faults
from lmtrain.data.prepare.corpus import BadDocuments, DataError, ShardJob, read_ahead

SHARDS_DIR = "shards"


def shard_name(i: int) -> str:
    return f"{SHARDS_DIR}/{i:05d}.bin"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


BATCH_DOCUMENTS = 1024  # documents per call of the fast tokenizer (it spreads one call over its threads)
BATCH_CHARS = 8_000_000  # and at most this much text: memory stays bounded whatever the documents' sizes


def encode_run(tok: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``texts``' ids, each document followed by eos, as one int64 array, and where each document
    starts in it (``len(texts) + 1`` offsets). A fast tokenizer encodes them all in one call."""
    if not hasattr(tok, "encode_batch"):  # bytes: each byte its id
        raw = [t.encode("utf-8") for t in texts]
        lengths = [len(b) + 1 for b in raw]
        flat = np.full(sum(lengths), tok.eos_id, dtype=np.int64)
        offsets = np.cumsum([0, *lengths])
        for b, lo in zip(raw, offsets[:-1]):
            flat[lo:lo + len(b)] = np.frombuffer(b, dtype=np.uint8)
        return flat, offsets
    lists = tok.encode_batch(texts)
    for ids in lists:  # fresh lists from the tokenizer: eos appended in place
        ids.append(tok.eos_id)
    lengths = [len(ids) for ids in lists]
    flat = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=sum(lengths))
    return flat, np.cumsum([0, *lengths])


class _Shard:
    """One shard being written: its temporary file, running digest and counts."""

    def __init__(self, root: Path, job: ShardJob, out_dtype: np.dtype) -> None:
        self.job, self.out_dtype = job, out_dtype
        self.final = root / shard_name(job.index)
        self.tmp = self.final.with_name(f".{self.final.name}.tmp-{os.getpid()}")
        self.skip = BadDocuments() if job.skip_bad else None
        self.h = hashlib.sha256()
        self.tokens = self.documents = 0
        self.read_all = False  # every document of its input is read (and pending or written)
        self.f: Any = None  # opened at its first documents: thousands of inputs are not thousands of open files

    def add(self, ids: np.ndarray, documents: int, vocab_size: int) -> None:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise DataError(f"{self.job.source}: the tokenizer produced id {int(ids.max())} outside its "
                            f"vocabulary of {vocab_size}")
        buf = ids.astype(self.out_dtype).tobytes()
        if self.f is None:
            self.f = open(self.tmp, "wb")
        self.f.write(buf)
        self.h.update(buf)
        self.tokens += ids.size
        self.documents += documents

    def close(self) -> dict[str, Any]:
        """The .bin renamed into place (durable), then its record; the record."""
        job, skip = self.job, self.skip
        if self.documents == 0:
            raise DataError(f"empty corpus: {job.source} holds no text (.txt empty, or every document's "
                            f"text empty{' or bad' if skip is not None else ''})")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        faults.point("prepare.shard", shard=job.index)
        os.replace(self.tmp, self.final)
        record = {"file": shard_name(job.index), "tokens": self.tokens, "documents": self.documents,
                  "sha256": self.h.hexdigest(), "recipe": job.recipe, "source": str(job.source.absolute()),
                  "source_sha256": sha256_file(job.source), "source_bytes": job.source.stat().st_size,
                  **({"skipped": skip.count, "skipped_examples": skip.examples} if skip is not None else {})}
        write_atomic(self.final.with_suffix(".json"), json.dumps(record, indent=1, sort_keys=True) + "\n",
                     durable=True)
        return record

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
        self.tmp.unlink(missing_ok=True)  # gone once renamed into place


class _Batches:
    """The documents read and not yet encoded, each with its shard; the shards open, in order."""

    def __init__(self, tok: Any, progress: Any) -> None:
        self.tok, self.progress = tok, progress
        self.records: list[dict[str, Any]] = []  # of the shards closed, in order
        self.live: list[_Shard] = []  # shards opened and not closed, in order
        self.texts: list[str] = []
        self.owners: list[_Shard] = []
        self.chars = self.documents = self.tokens = 0

    def add(self, shard: _Shard, docs: list[str] | None) -> None:
        if not self.live or self.live[-1] is not shard:
            self.live.append(shard)
        if docs is None:  # its input is read to the end
            shard.read_all = True
            return
        for doc in docs:
            self.texts.append(doc)
            self.owners.append(shard)
            self.chars += len(doc)
            if len(self.texts) >= BATCH_DOCUMENTS or self.chars >= BATCH_CHARS:
                self.flush()

    def flush(self) -> None:
        """Encode what is pending in one call, write each shard's run, close the shards read to the end."""
        flat, offsets = encode_run(self.tok, self.texts)
        i, owners = 0, self.owners
        while i < len(owners):
            j = i
            while j < len(owners) and owners[j] is owners[i]:
                j += 1
            owners[i].add(flat[offsets[i]:offsets[j]], j - i, self.tok.vocab_size)
            self.documents, self.tokens = self.documents + j - i, self.tokens + int(offsets[j] - offsets[i])
            i = j
        self.texts, self.owners, self.chars = [], [], 0
        while self.live and self.live[0].read_all:
            self.records.append(self.live.pop(0).close())
        if self.progress is not None:
            self.progress(self.documents, self.tokens)

    def finish_before_bad(self) -> None:
        """An input could not be read: the shards before it are written and closed (kept), its own dropped."""
        bad = next((s for s in self.live if not s.read_all), None)
        keep = [k for k, o in enumerate(self.owners) if o is not bad]
        self.texts, self.owners = [self.texts[k] for k in keep], [self.owners[k] for k in keep]
        if bad is not None:
            self.live.remove(bad)
        self.flush()


def write_many(root: Path, jobs: Sequence[ShardJob], tok: Any, out_dtype: np.dtype, *,
               progress: Any = None) -> list[dict[str, Any]]:
    """Tokenize each job's input into its shard ``root/shards/NNNNN.bin`` and record (each atomic
    and durable); the records, in order. ``progress(documents, tokens)`` after each batch.

    The documents of consecutive inputs are encoded together, up to :data:`BATCH_DOCUMENTS` (or
    :data:`BATCH_CHARS` of text) per call of the tokenizer whatever the files' sizes, and split back
    into their shards: the same bytes as file by file. A shard is closed as soon as its last
    document is written, so a stopped preparation loses at most one batch. An input that cannot be
    read is an error after the shards of the inputs before it are finished (they are kept).
    """
    (root / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    shards = [_Shard(root, job, out_dtype) for job in jobs]
    batches = _Batches(tok, progress)
    reading = read_ahead([(job.source, job.text_key, shard.skip) for job, shard in zip(jobs, shards)])
    try:
        with contextlib.closing(reading):  # type: ignore[type-var]
            for k, docs in reading:
                batches.add(shards[k], docs)
            batches.flush()
    except DataError:
        try:
            batches.finish_before_bad()
        finally:
            for s in shards:
                s.abort()
        raise
    except BaseException:
        for s in shards:
            s.abort()
        raise
    return batches.records


def finished(root: Path, job: ShardJob, itemsize: int) -> dict[str, Any] | None:
    """The record of shard ``job.index`` when it is finished for this input (its .bin the size
    the record says, the input file the same size and checksum, made by the same recipe: the
    tokenizer's content, the text field, --skip-bad); else None."""
    try:
        record = json.loads((root / shard_name(job.index)).with_suffix(".json").read_text())
        size = (root / record["file"]).stat().st_size
        same_input = (record["source"] == str(job.source.absolute()) and record.get("recipe") == job.recipe
                      and record.get("source_bytes") == job.source.stat().st_size)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if size != int(record["tokens"]) * itemsize or not same_input:
        return None
    if record["source_sha256"] != sha256_file(job.source):
        return None
    return dict(record)


def index(records: list[dict[str, Any]], *, dtype: str, vocab_size: int, eos_id: int, tokenizer: dict[str, Any],
          text_key: str, skip_bad: bool) -> dict[str, Any]:
    """meta.json (version 2) for shards ``records``, in input order."""
    digest = hashlib.sha256("".join(r["sha256"] for r in records).encode()).hexdigest()
    shards = [{k: r[k] for k in ("file", "tokens", "documents", "sha256")} for r in records]
    sources = [{"path": r["source"], "sha256": r["source_sha256"], "documents": r["documents"], "tokens": r["tokens"],
                **({"skipped": r.get("skipped", 0)} if skip_bad else {})} for r in records]
    meta: dict[str, Any] = {
        "format": "lmtrain-tokens", "version": 2, "dtype": dtype, "vocab_size": vocab_size, "eos_id": eos_id,
        "num_tokens": sum(r["tokens"] for r in records), "num_documents": sum(r["documents"] for r in records),
        "tokens_sha256": digest, "tokenizer": tokenizer, "text_key": text_key, "shards": shards, "sources": sources,
    }
    if skip_bad:
        examples = [e for r in records for e in r.get("skipped_examples", [])][:5]
        meta["skipped_documents"] = {"count": sum(r.get("skipped", 0) for r in records), "examples": examples}
    return meta


class TokenStream:
    """The store's shards read as one array of ids: ``read(lo, n)`` copies tokens lo..lo+n-1,
    across shard boundaries, from memmaps opened lazily (and never pickled to DataLoader workers)."""

    def __init__(self, root: Path, shards: list[tuple[str, int]], dtype: np.dtype) -> None:
        self.root, self.dtype = Path(root), dtype
        self.files = [f for f, _ in shards]
        self.starts: list[int] = list(accumulate((n for _, n in shards), initial=0))  # S + 1 (bisect)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def _map(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            n = self.starts[i + 1] - self.starts[i]
            # a plain ndarray over the map (it keeps the map open): slicing it skips memmap's per-slice bookkeeping
            m = self._maps[i] = np.memmap(self.root / self.files[i], dtype=self.dtype, mode="r",
                                          shape=(n,)).view(np.ndarray)
        return m

    def read(self, lo: int, n: int) -> np.ndarray:
        if lo < 0 or lo + n > len(self):
            raise IndexError(f"tokens {lo}..{lo + n} outside 0..{len(self)}")
        starts = self.starts
        i = bisect.bisect_right(starts, lo) - 1
        parts = []
        while n > 0:
            off = lo - starts[i]
            take = min(n, starts[i + 1] - lo)
            parts.append(self._map(i)[off:off + take])
            lo, n, i = lo + take, n - take, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}
