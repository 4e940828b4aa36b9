"""Prepared data: writing a sharded token store from local inputs, and reading its metadata.

No torch here (numpy only), so ``lmlaunch data prepare`` and anything on the login node that
wants to look at prepared data stay light. The runtime side (datasets, sampler, loaders) is
in :mod:`lmtrain.data.loader`; the store's layout (one shard per input file, each atomic, and the index
``meta.json``) is :mod:`lmtrain.data.prepare.token_store`'s; the inputs are :mod:`lmtrain.data.prepare.corpus`'s.

``meta.json`` (version 2)::

    {"format": "lmtrain-tokens", "version": 2, "dtype": "uint16", "num_tokens": N, "vocab_size": V,
     "eos_id": E, "num_documents": D, "tokens_sha256": "...", "tokenizer": {...}, "text_key": "text",
     "shards": [{"file": "shards/00000.bin", "tokens", "documents", "sha256"}, ...],
     "sources": [{"path", "sha256", "documents", "tokens"}, ...], "skipped_documents": {...}}

Version 1 (one flat ``tokens.bin``) is still read. The same inputs and tokenizer always give the
same bytes. A local preparation is written under a temporary name and renamed into place, so a
reader never sees a half-written or mixed directory.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmcore.atomic import write_atomic
from lmtrain.data.prepare.corpus import DataError, Preparation, ShardJob, collect_inputs
from lmtrain.data.prepare.token_store import finished, index, sha256_file, shard_name, write_many
from lmtrain.data.prepare.tokenizer import load_tokenizer

__all__ = ["DataError", "PrepareResult", "TokenMeta", "collect_inputs", "prepare", "read_meta", "shipped_corpus_files"]

FORMAT = "lmtrain-tokens"
VERSION = 2
READABLE_VERSIONS = (1, 2)
TOKENS_FILE = "tokens.bin"  # version 1's one flat file
META_FILE = "meta.json"
# The corpus that ships with the project (see data/corpus/README.md): real English prose.
REPO_CORPUS_DIR = Path(__file__).resolve().parents[4] / "data" / "corpus"  # a checkout, above src/lmtrain/data/prepare
WHEEL_CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpus"  # the same files in an installed wheel (lmtrain.data.corpus)
SHIPPED_CORPUS_DIR = REPO_CORPUS_DIR if REPO_CORPUS_DIR.is_dir() else WHEEL_CORPUS_DIR
SHIPPED_CORPUS_FILES = ("licenses.jsonl", "python-docs.jsonl")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class TokenMeta:
    """The validated contents of a prepared directory's meta.json."""

    dtype: str
    num_tokens: int
    vocab_size: int
    eos_id: int
    num_documents: int
    tokens_sha256: str
    tokenizer: dict[str, Any] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    skipped_documents: dict[str, Any] | None = None  # --skip-bad: {"count", "examples"}
    shards: list[dict[str, Any]] = field(default_factory=list)  # {"file", "tokens", "documents", "sha256"}
    text_key: str = "text"
    version: int = VERSION

    @property
    def np_dtype(self) -> np.dtype:
        """The on-disk dtype (little-endian, as prepare writes it)."""
        return np.dtype(_DTYPES[self.dtype]).newbyteorder("<")

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "version": self.version,
            "dtype": self.dtype,
            "num_tokens": self.num_tokens,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "num_documents": self.num_documents,
            "tokens_sha256": self.tokens_sha256,
            "tokenizer": self.tokenizer,
            "sources": self.sources,
            **({"skipped_documents": self.skipped_documents} if self.skipped_documents is not None else {}),
        }
        if self.version >= 2:
            out.update(shards=self.shards, text_key=self.text_key)
        return out


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 holds ids 0..65535, so vocabularies up to 65536 entries; uint32 beyond."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _meta_fields(raw: dict[str, Any], meta_path: Path) -> TokenMeta:
    """meta.json's fields, each checked for its type and range (DataError naming the field)."""

    def need_int(key: str, minimum: int) -> int:
        v = raw.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise DataError(f"{meta_path}: '{key}' must be an integer >= {minimum}, got {v!r}")
        return v

    dtype = raw.get("dtype")
    if dtype not in _DTYPES:
        raise DataError(f"{meta_path}: 'dtype' must be one of {sorted(_DTYPES)}, got {dtype!r}")
    num_tokens, vocab_size = need_int("num_tokens", 1), need_int("vocab_size", 1)
    eos_id, num_documents = need_int("eos_id", 0), need_int("num_documents", 0)
    if eos_id >= vocab_size:
        raise DataError(f"{meta_path}: 'eos_id' ({eos_id}) must be < 'vocab_size' ({vocab_size})")
    if vocab_size > np.iinfo(_DTYPES[dtype]).max + 1:
        raise DataError(f"{meta_path}: 'vocab_size' ({vocab_size}) does not fit 'dtype' {dtype}")
    sha = raw.get("tokens_sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        raise DataError(f"{meta_path}: 'tokens_sha256' must be a 64-character hex digest, got {sha!r}")
    tokenizer, sources = raw.get("tokenizer"), raw.get("sources")
    version = int(raw["version"])
    if version == 1:
        shards = [{"file": TOKENS_FILE, "tokens": num_tokens, "documents": num_documents, "sha256": sha}]
    else:
        shards = _shards(raw.get("shards"), meta_path, num_tokens)
    return TokenMeta(
        dtype=dtype, num_tokens=num_tokens, vocab_size=vocab_size, eos_id=eos_id, num_documents=num_documents,
        tokens_sha256=sha, tokenizer=tokenizer if isinstance(tokenizer, dict) else {},
        sources=sources if isinstance(sources, list) else [],
        skipped_documents=raw["skipped_documents"] if isinstance(raw.get("skipped_documents"), dict) else None,
        shards=shards, text_key=str(raw.get("text_key", "text")), version=version,
    )


def _shards(raw: Any, meta_path: Path, num_tokens: int) -> list[dict[str, Any]]:
    """The index's shard list, each entry checked (a relative file under shards/, counts, digest)."""
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{meta_path}: 'shards' must be a non-empty list of the store's shard files")
    out = []
    for i, s in enumerate(raw):
        ok = (isinstance(s, dict) and isinstance(s.get("file"), str) and s["file"].startswith("shards/")
              and ".." not in s["file"] and isinstance(s.get("tokens"), int) and s["tokens"] >= 1
              and isinstance(s.get("sha256"), str) and len(s["sha256"]) == 64)
        if not ok:
            raise DataError(f"{meta_path}: shards[{i}] must be {{file: shards/..., tokens: >= 1, sha256: 64 hex}}, "
                            f"got {str(s)[:200]}")
        out.append(s)
    total = sum(s["tokens"] for s in out)
    if total != num_tokens:
        raise DataError(f"{meta_path}: its shards hold {total} tokens, but 'num_tokens' is {num_tokens}")
    return out


def read_meta(path: str | Path, *, verify_checksum: bool = False) -> TokenMeta:
    """Read and validate ``path/meta.json`` against ``path/tokens.bin``.

    Checks the format tag, every field's type and range, and that tokens.bin holds exactly
    ``num_tokens`` ids of ``dtype``; with ``verify_checksum`` also its sha256 (reads it all).
    Raises DataError naming the file, the field and what was expected.
    """
    d = Path(path)
    hint = "; make it with: lmlaunch data prepare INPUT... --out " + str(d)
    if not d.is_dir():
        raise DataError(f"data.path {d}: no such directory{hint}")
    meta_path = d / META_FILE
    if not meta_path.is_file():
        raise DataError(f"{meta_path}: missing (not a prepared data directory){hint}")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{meta_path}: not valid JSON ({exc}){hint}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DataError(f"{meta_path}: 'format' must be '{FORMAT}' (this is not lmtrain token data){hint}")
    if raw.get("version") not in READABLE_VERSIONS:
        raise DataError(
            f"{meta_path}: 'version' is {raw.get('version')!r}, this lmtrain reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}{hint}"
        )

    meta = _meta_fields(raw, meta_path)
    for shard in meta.shards:
        _check_shard(d, meta, shard, hint, verify_checksum)
    return meta


def _check_shard(d: Path, meta: TokenMeta, shard: dict[str, Any], hint: str, verify: bool) -> None:
    """The shard file is there with exactly its ids; with ``verify``, its sha256 too."""
    path = d / shard["file"]
    what = "the data is truncated or corrupt"
    if not path.is_file():
        raise DataError(f"{path}: missing (meta.json lists it){hint}")
    expected, actual = shard["tokens"] * meta.itemsize, path.stat().st_size
    if actual != expected:
        raise DataError(
            f"{path}: {actual} bytes, but meta.json says "
            f"{'num_tokens' if meta.version == 1 else 'its tokens'}({shard['tokens']}) x "
            f"{meta.dtype}({meta.itemsize} bytes) = {expected} bytes; {what}{hint}"
        )
    if verify:
        got = sha256_file(path)
        if got != shard["sha256"]:
            listed = "meta.json tokens_sha256" if meta.version == 1 else "its sha256 in meta.json"
            raise DataError(f"{path}: sha256 {got} does not match {listed} {shard['sha256']}; "
                            f"the data is corrupt{hint}")


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class PrepareResult:
    out: Path
    meta: TokenMeta
    skipped: bool  # --if-missing found valid data already there


def write_shards(root: Path, prep: Preparation, jobs: Sequence[ShardJob], *, progress: Any = None,
                 on_kept: Any = None, tok: Any = None) -> list[dict[str, Any]]:
    """Shards ``jobs`` of ``prep`` into ``root``: those already finished (this input, these sizes)
    are kept as they are (``on_kept(record)``), the rest written; their records, in order."""
    tok = tok or load_tokenizer(prep.tokenizer)
    out_dtype = np.dtype(_DTYPES[dtype_for_vocab(tok.vocab_size)]).newbyteorder("<")  # little-endian everywhere
    kept: dict[int, dict[str, Any]] = {}
    for job in jobs:
        record = finished(root, job, out_dtype.itemsize)
        if record is not None:
            kept[job.index] = record
            if on_kept is not None:
                on_kept(record)
    written = iter(write_many(root, [j for j in jobs if j.index not in kept], tok, out_dtype, progress=progress))
    return [kept[j.index] if j.index in kept else next(written) for j in jobs]


def write_index(root: Path, prep: Preparation, tok: Any = None) -> TokenMeta:
    """Every shard finished: the index ``root/meta.json`` (atomic, durable); DataError naming the
    shards that are not."""
    tok = tok or load_tokenizer(prep.tokenizer)
    dtype = dtype_for_vocab(tok.vocab_size)
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    records, missing = [], []
    for job in prep.jobs():
        record = finished(root, job, itemsize)
        if record is None:
            missing.append(f"{shard_name(job.index)} ({job.source})")
        else:
            records.append(record)
    if missing:
        raise DataError(f"{root}: {len(missing)} shard(s) not finished: {', '.join(missing[:5])}")
    meta = index(records, dtype=dtype, vocab_size=tok.vocab_size, eos_id=tok.eos_id, tokenizer=tok.describe(),
                 text_key=prep.text_key, skip_bad=prep.skip_bad)
    write_atomic(root / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n", durable=True)
    return read_meta(root)


def prepare(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    if_missing: bool = False,
    text_key: str = "text",
    skip_bad: bool = False,
    progress: Any = None,
) -> PrepareResult:
    """Tokenize ``inputs`` into the sharded store ``out`` (atomically: a reader sees the old
    directory or the new one); ``progress(documents, tokens)`` after each batch of a shard.

    ``tokenizer`` is a local transformers tokenizer directory, or None for bytes (vocab 260).
    With ``if_missing``, valid prepared data already in ``out`` is kept as it is. ``text_key``:
    the JSON field or parquet column holding each document's text. ``skip_bad``: bad documents
    are counted (meta.json ``skipped_documents``) and left out instead of stopping with an error.
    """
    out = Path(out).expanduser().absolute()
    if if_missing and (out / META_FILE).exists():
        try:
            return PrepareResult(out=out, meta=read_meta(out), skipped=True)
        except DataError:
            pass  # present but broken: rebuild it below
    prep = Preparation(collect_inputs(inputs), None if tokenizer is None else str(tokenizer), text_key, skip_bad)
    tok = load_tokenizer(prep.tokenizer)  # a bad tokenizer directory before anything is read
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_shards(tmp, prep, prep.jobs(), tok=tok, progress=progress)
        write_index(tmp, prep, tok)
        os.chmod(tmp, 0o755)
        installed = replace_dir(tmp, out, keep_existing=if_missing)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(out=out, meta=read_meta(out), skipped=not installed)


def replace_dir(tmp: Path, out: Path, *, keep_existing: bool) -> bool:
    """Move the finished ``tmp`` directory to ``out``; False when valid data that appeared in
    the meantime was kept instead (``keep_existing``).

    A reader sees the old data, the new data, or (for the instant between two renames when
    replacing) no directory, which read_meta reports; never a mix of the two.
    """
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    try:
        os.rename(tmp, out)  # succeeds when out is absent (or an empty directory)
        _fsync_dir(out.parent)
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if keep_existing and _is_valid(out):
        # A concurrent `prepare --if-missing` finished first: keep its data.
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / "data")
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
    return True


def _is_valid(out: Path) -> bool:
    try:
        read_meta(out)
    except DataError:
        return False
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shipped_corpus_files() -> list[Path]:
    """The committed corpus files (data/corpus/*.jsonl), checked to be present."""
    files = [SHIPPED_CORPUS_DIR / name for name in SHIPPED_CORPUS_FILES]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise DataError(
            f"the shipped corpus is missing: {', '.join(missing)} (it lives in the lmlaunch "
            "source tree under data/corpus/ and in the wheel as lmtrain/data/corpus/: reinstall lmlaunch)"
        )
    return files
