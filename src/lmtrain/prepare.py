"""The prepared-data format (``tokens.bin`` + ``meta.json``): writing it and reading its metadata.

No torch here (numpy only), so ``lmlaunch data prepare`` and anything on the login node that
wants to look at prepared data stay light. The runtime side (datasets, sampler, loaders) is
in :mod:`lmtrain.data`.

Format of a prepared directory::

    tokens.bin   every document's token ids, each document followed by eos, concatenated;
                 a flat little-endian array of ``dtype`` (uint16 when vocab_size <= 65536)
    meta.json    {"format": "lmtrain-tokens", "version": 1, "dtype": "uint16",
                  "num_tokens": N, "vocab_size": V, "eos_id": E, "num_documents": D,
                  "tokens_sha256": "...", "tokenizer": {...}, "sources": [{"path", "sha256",
                  "documents", "tokens"}, ...]}

Inputs: ``.txt`` files (one document per file) and ``.jsonl`` files (one document per line,
a JSON object with a string ``"text"``); directories are searched for both, in sorted order.
The same inputs and tokenizer always give the same bytes. The directory is written under a
temporary name and renamed into place, so a reader never sees a half-written or mixed directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from launcher.core.atomic import write_atomic
from launcher.core.errors import UserError
from lmtrain.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

FORMAT = "lmtrain-tokens"
VERSION = 1
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
INPUT_SUFFIXES = (".txt", ".jsonl")
# The corpus that ships with the project (see data/corpus/README.md): real English prose.
SHIPPED_CORPUS_DIR = Path(__file__).resolve().parents[2] / "data" / "corpus"
SHIPPED_CORPUS_FILES = ("licenses.jsonl", "python-docs.jsonl")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(UserError):
    """Prepared data or its inputs are missing, malformed or inconsistent (exit code 2)."""


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

    @property
    def np_dtype(self) -> np.dtype:
        """The on-disk dtype (little-endian, as prepare writes it)."""
        return np.dtype(_DTYPES[self.dtype]).newbyteorder("<")

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "num_tokens": self.num_tokens,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "num_documents": self.num_documents,
            "tokens_sha256": self.tokens_sha256,
            "tokenizer": self.tokenizer,
            "sources": self.sources,
        }


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
    return TokenMeta(
        dtype=dtype, num_tokens=num_tokens, vocab_size=vocab_size, eos_id=eos_id, num_documents=num_documents,
        tokens_sha256=sha, tokenizer=tokenizer if isinstance(tokenizer, dict) else {},
        sources=sources if isinstance(sources, list) else [],
    )


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
    if raw.get("version") != VERSION:
        raise DataError(
            f"{meta_path}: 'version' is {raw.get('version')!r}, this lmtrain reads version {VERSION}{hint}"
        )

    meta = _meta_fields(raw, meta_path)
    tokens_path = d / TOKENS_FILE
    if not tokens_path.is_file():
        raise DataError(f"{tokens_path}: missing (meta.json is there but the tokens are not){hint}")
    expected = meta.num_tokens * meta.itemsize
    actual = tokens_path.stat().st_size
    if actual != expected:
        raise DataError(
            f"{tokens_path}: {actual} bytes, but meta.json says num_tokens({meta.num_tokens}) x "
            f"{meta.dtype}({meta.itemsize} bytes) = {expected} bytes; the data is truncated or "
            f"corrupt{hint}"
        )
    if verify_checksum:
        got = _sha256_file(tokens_path)
        if got != meta.tokens_sha256:
            raise DataError(
                f"{tokens_path}: sha256 {got} does not match meta.json tokens_sha256 "
                f"{meta.tokens_sha256}; the data is corrupt{hint}"
            )
    return meta


# ---------------------------------------------------------------------------------------------
# Inputs


def collect_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files to tokenize, in a fixed order: given files as given, directories' files sorted."""
    if not inputs:
        raise DataError("no input: give text files (.txt, .jsonl) or directories, or --shipped-corpus")
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in INPUT_SUFFIXES)
            if not found:
                raise DataError(f"{p}: directory holds no {' or '.join(INPUT_SUFFIXES)} files")
            files.extend(found)
        elif p.is_file():
            if p.suffix not in INPUT_SUFFIXES:
                raise DataError(
                    f"{p}: unsupported input type '{p.suffix}'; allowed: {', '.join(INPUT_SUFFIXES)}"
                )
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    return files


def iter_documents(path: Path) -> Iterator[str]:
    """The documents in one input file: the whole .txt file, or each .jsonl line's "text".

    .jsonl files are streamed line by line, so inputs larger than memory work.
    """
    try:
        if path.suffix == ".txt":
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") from exc
            if text:
                yield text
            return
        with open(path, "rb") as f:
            for lineno, bline in enumerate(f, start=1):
                try:
                    line = bline.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: not UTF-8 text (invalid byte at column {exc.start + 1})"
                    ) from exc
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: not a JSON object ({exc.msg} at column {exc.colno})"
                    ) from exc
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    found = f"keys {sorted(obj)}" if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
                    raise DataError(
                        f'{path}:{lineno}: each line must be a JSON object with a string "text" (found {found})'
                    )
                if obj["text"]:
                    yield obj["text"]
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc


def _encoded(tok: ByteTokenizer | HFTokenizer, docs: Iterator[str], batch: int = 256) -> Iterator[np.ndarray]:
    """Each document's ids followed by eos, as an int64 array."""
    eos = np.array([tok.eos_id], dtype=np.int64)
    if isinstance(tok, ByteTokenizer):
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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class PrepareResult:
    out: Path
    meta: TokenMeta
    skipped: bool  # --if-missing found valid data already there


def _write_tokens(target: Path, files: list[Path], tok: Any, out_dtype: Any) -> tuple[list[dict[str, Any]], int, int, str]:
    """Every document of ``files``, tokenized, into ``target`` (fsynced): the per-file sources,
    the token and document counts and the tokens' sha256."""
    sources: list[dict[str, Any]] = []
    h = hashlib.sha256()
    total = n_docs = 0
    with open(target, "wb") as f:
        for path in files:
            file_tokens = file_docs = 0
            for arr in _encoded(tok, iter_documents(path)):
                if arr.min() < 0 or arr.max() >= tok.vocab_size:
                    raise DataError(
                        f"{path}: the tokenizer produced id {int(arr.max())} outside its vocabulary of {tok.vocab_size}"
                    )
                buf = arr.astype(out_dtype).tobytes()
                f.write(buf)
                h.update(buf)
                file_tokens += arr.size
                file_docs += 1
            sources.append({"path": str(path.absolute()), "sha256": _sha256_file(path), "documents": file_docs,
                            "tokens": file_tokens})
            total += file_tokens
            n_docs += file_docs
        f.flush()
        os.fsync(f.fileno())
    return sources, total, n_docs, h.hexdigest()


def prepare(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    if_missing: bool = False,
) -> PrepareResult:
    """Tokenize ``inputs`` into ``out/tokens.bin`` + ``out/meta.json`` (atomically).

    ``tokenizer`` is a local transformers tokenizer directory, or None for bytes (vocab 260).
    With ``if_missing``, valid prepared data already in ``out`` is kept as it is.
    """
    out = Path(out).expanduser().absolute()
    if if_missing and (out / META_FILE).exists():
        try:
            return PrepareResult(out=out, meta=read_meta(out), skipped=True)
        except DataError:
            pass  # present but broken: rebuild it below
    files = collect_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    dtype = dtype_for_vocab(tok.vocab_size)
    out_dtype = np.dtype(_DTYPES[dtype]).newbyteorder("<")  # the file is little-endian everywhere

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        sources, total, n_docs, digest = _write_tokens(tmp / TOKENS_FILE, files, tok, out_dtype)
        if n_docs == 0:
            raise DataError(
                f"empty corpus: {', '.join(str(p) for p in files)} hold no text "
                '(.txt files are empty, or .jsonl lines have empty "text")'
            )
        meta = TokenMeta(
            dtype=dtype,
            num_tokens=total,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            num_documents=n_docs,
            tokens_sha256=digest,
            tokenizer=tok.describe(),
            sources=sources,
        )
        write_atomic(tmp / META_FILE, json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n", durable=True)
        os.chmod(tmp, 0o755)
        installed = _replace_dir(tmp, out, keep_existing=if_missing)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(out=out, meta=read_meta(out), skipped=not installed)


def _replace_dir(tmp: Path, out: Path, *, keep_existing: bool) -> bool:
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
            "source tree under data/corpus/; install lmlaunch editable from a checkout)"
        )
    return files
