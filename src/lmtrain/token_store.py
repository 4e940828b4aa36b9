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

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from launcher.core.atomic import write_atomic
from lmtrain.corpus import BadDocuments, DataError, ShardJob, iter_documents

SHARDS_DIR = "shards"


def shard_name(i: int) -> str:
    return f"{SHARDS_DIR}/{i:05d}.bin"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def encoded(tok: Any, docs: Iterable[str], batch: int = 1024) -> Iterator[np.ndarray]:
    """Each document's ids followed by eos, as an int64 array; a fast tokenizer encodes in batches."""
    eos = np.array([tok.eos_id], dtype=np.int64)
    if not hasattr(tok, "encode_batch"):  # bytes
        for doc in docs:
            yield np.concatenate([np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int64), eos])
        return
    pending: list[str] = []
    for doc in docs:
        pending.append(doc)
        if len(pending) == batch:
            for ids in tok.encode_batch(pending):
                yield np.asarray(ids + [tok.eos_id], dtype=np.int64)
            pending = []
    for ids in tok.encode_batch(pending) if pending else []:
        yield np.asarray(ids + [tok.eos_id], dtype=np.int64)


def write_shard(root: Path, job: ShardJob, tok: Any, out_dtype: np.dtype, *,
                progress: Any = None) -> dict[str, Any]:
    """Tokenize ``job.source`` into ``root/shards/NNNNN.bin`` and its record (both atomic and
    durable); the record. ``progress(documents, tokens)`` is called as it goes."""
    (root / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    final = root / shard_name(job.index)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    skip = BadDocuments() if job.skip_bad else None
    h = hashlib.sha256()
    tokens = documents = 0
    try:
        with open(tmp, "wb") as f:
            for arr in encoded(tok, iter_documents(job.source, text_key=job.text_key, skip=skip)):
                if arr.min() < 0 or arr.max() >= tok.vocab_size:
                    raise DataError(f"{job.source}: the tokenizer produced id {int(arr.max())} outside its "
                                    f"vocabulary of {tok.vocab_size}")
                buf = arr.astype(out_dtype).tobytes()
                f.write(buf)
                h.update(buf)
                tokens += arr.size
                documents += 1
                if progress is not None and documents % 1000 == 0:
                    progress(documents, tokens)
            f.flush()
            os.fsync(f.fileno())
        if documents == 0:
            raise DataError(f"empty corpus: {job.source} holds no text (.txt empty, or every document's "
                            f"text empty{' or bad' if skip is not None else ''})")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    record = {"file": shard_name(job.index), "tokens": tokens, "documents": documents, "sha256": h.hexdigest(),
              "source": str(job.source.absolute()), "source_sha256": sha256_file(job.source),
              "source_bytes": job.source.stat().st_size,
              **({"skipped": skip.count, "skipped_examples": skip.examples} if skip is not None else {})}
    write_atomic(final.with_suffix(".json"), json.dumps(record, indent=1, sort_keys=True) + "\n", durable=True)
    if progress is not None:
        progress(documents, tokens)
    return record


def finished(root: Path, job: ShardJob, itemsize: int) -> dict[str, Any] | None:
    """The record of shard ``job.index`` when it is finished for this input (its .bin the size
    the record says, the input file the same size and checksum); else None."""
    try:
        record = json.loads((root / shard_name(job.index)).with_suffix(".json").read_text())
        size = (root / record["file"]).stat().st_size
        same_input = (record["source"] == str(job.source.absolute())
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
        self.starts = np.cumsum([0] + [n for _, n in shards])  # (S + 1,)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _map(self, i: int) -> np.memmap:
        m = self._maps.get(i)
        if m is None:
            n = int(self.starts[i + 1] - self.starts[i])
            m = self._maps[i] = np.memmap(self.root / self.files[i], dtype=self.dtype, mode="r", shape=(n,))
        return m

    def read(self, lo: int, n: int) -> np.ndarray:
        if lo < 0 or lo + n > len(self):
            raise IndexError(f"tokens {lo}..{lo + n} outside 0..{len(self)}")
        i = int(np.searchsorted(self.starts, lo, side="right")) - 1
        parts = []
        while n > 0:
            off = lo - int(self.starts[i])
            take = min(n, int(self.starts[i + 1]) - lo)
            parts.append(self._map(i)[off:off + take])
            lo, n, i = lo + take, n - take, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}
