"""The inputs of ``lmlaunch data prepare``: which files, and their documents, read as streams.

Formats (by suffix):

- ``.txt``: one document per file;
- ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``: one document per line, a JSON object whose text is
  under ``text_key`` (default ``text``), decompressed as a stream (gzip, zstandard): memory stays
  bounded whatever the file's size;
- ``.parquet``: one document per row of the column ``text_key``, read in record batches (pyarrow).

Inputs are files, directories (searched recursively for those suffixes, sorted) and glob
patterns (``corpus/**/*.jsonl.zst``, sorted); the same inputs always give the same files in the
same order, which is what makes a preparation reproducible and splittable into slices.

A bad document (a line that is not JSON, one without the text field or with a non-string text,
text that is not UTF-8, a null parquet cell) is an error naming the file and the line or row;
with a :class:`BadDocuments` counter (``--skip-bad``) it is counted and skipped instead. A file
that cannot be read as its format at all (a corrupt .gz/.zst stream, a damaged parquet file) is
always an error naming the file (and how far it was read): there is no next document to go on to.

:class:`Preparation` (which files, which tokenizer, how documents are read) and its
:class:`ShardJob` records live here too, with the standard library only: the launcher plans a
preparation on the cluster (launcher.submit.data_cluster) without numpy.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import hashlib
import io
import json
import queue
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lmcore.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
PARQUET_BATCH_ROWS = 1024


class DataError(UserError):
    """Prepared data or its inputs are missing, malformed or inconsistent (exit code 2)."""


def input_suffix(path: Path) -> str | None:
    """The input format of ``path`` (one of :data:`SUFFIXES`), or None."""
    name = path.name
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def collect_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files to tokenize, in a fixed order: files as given, directories' and globs' files sorted."""
    if not inputs:
        raise DataError(f"no input: give files ({', '.join(SUFFIXES)}), directories or glob patterns, "
                        "or --shipped-corpus")
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        p = Path(text).expanduser()
        if any(c in text for c in "*?[") and not p.exists():
            matched = sorted(Path(m) for m in glob.glob(str(p), recursive=True))
            found = [m for m in matched if m.is_file() and input_suffix(m)]
            if not found:
                raise DataError(f"{text}: the pattern matches no {', '.join(SUFFIXES)} file"
                                + (f" ({len(matched)} other path(s))" if matched else ""))
            files.extend(found)
        elif p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and input_suffix(q))
            if not found:
                raise DataError(f"{p}: directory holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif p.is_file():
            if input_suffix(p) is None:
                raise DataError(f"{p}: unsupported input type '{''.join(p.suffixes) or p.name}'; "
                                f"allowed: {', '.join(SUFFIXES)}")
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    return files


@dataclass
class BadDocuments:
    """``--skip-bad``: documents skipped, with the first few places (file:line or file:row)."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(problem)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "examples": list(self.examples)}


def iter_documents(path: Path, *, text_key: str = "text", skip: BadDocuments | None = None) -> Iterator[str]:
    """The documents of one input file, in order (empty texts left out)."""
    kind = input_suffix(path)
    try:
        if kind == ".txt":
            yield from _txt(path, skip)
        elif kind == ".parquet":
            yield from _parquet(path, text_key, skip)
        elif kind is not None:
            yield from _jsonl(path, kind, text_key, skip)
        else:
            raise DataError(f"{path}: unsupported input type; allowed: {', '.join(SUFFIXES)}")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (DataError, MemoryError):
        raise
    except Exception as exc:  # a reader's failure nobody foresaw on damaged data: still the file named
        raise DataError(f"{path}: cannot be read as {kind} ({type(exc).__name__}: {str(exc)[:300]}); "
                        "the file is corrupt or not what its name says") from exc


def _bad(problem: str, skip: BadDocuments | None) -> None:
    if skip is None:
        raise DataError(problem + " (--skip-bad counts and skips such documents)")
    skip.add(problem)


def _txt(path: Path, skip: BadDocuments | None) -> Iterator[str]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _bad(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})", skip)
        return
    if text:
        yield text


def _open_stream(path: Path, kind: str) -> IO[bytes]:
    if kind == ".jsonl.gz":
        return gzip.GzipFile(path, "rb")  # type: ignore[return-value]
    if kind == ".jsonl.zst":
        import zstandard

        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))  # type: ignore[arg-type]
    return open(path, "rb")


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - a runtime dependency
        pass
    return tuple(errors)


def _jsonl(path: Path, kind: str, text_key: str, skip: BadDocuments | None) -> Iterator[str]:
    lineno = 0
    try:
        with _open_stream(path, kind) as f:
            for lineno, bline in enumerate(f, start=1):
                doc = _json_line(path, lineno, bline, text_key, skip)
                if doc:
                    yield doc
    except _stream_errors() as exc:
        raise DataError(f"{path}: not a readable {kind} stream after line {lineno} "
                        f"({type(exc).__name__}: {exc}); the file is corrupt or truncated") from exc


def _json_line(path: Path, lineno: int, bline: bytes, text_key: str, skip: BadDocuments | None) -> str | None:
    try:
        line = bline.decode("utf-8")
    except UnicodeDecodeError as exc:
        _bad(f"{path}:{lineno}: not UTF-8 text (invalid byte at column {exc.start + 1})", skip)
        return None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        _bad(f"{path}:{lineno}: not a JSON object ({exc.msg} at column {exc.colno})", skip)
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
        found = (f"keys {sorted(obj)[:10]}" if isinstance(obj, dict) and text_key not in obj
                 else f"{text_key!r} is a {type(obj.get(text_key)).__name__}" if isinstance(obj, dict)
                 else f"a JSON {type(obj).__name__}")
        _bad(f'{path}:{lineno}: each line must be a JSON object with a string "{text_key}" (found {found})', skip)
        return None
    text: str = obj[text_key]
    return text


def _parquet(path: Path, text_key: str, skip: BadDocuments | None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
    names = pf.schema_arrow.names
    if text_key not in names:
        raise DataError(f"{path}: no column {text_key!r} (its columns: {', '.join(names[:20])}); "
                        f"name the text column with --text-key")
    field_type = pf.schema_arrow.field(text_key).type
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
        raise DataError(f"{path}: column {text_key!r} holds {field_type}, not strings")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key]):
            for text in _texts(batch.column(0)):
                row += 1
                if text is None:
                    _bad(f"{path}: row {row}: {text_key!r} is null", skip)
                elif isinstance(text, UnicodeDecodeError):
                    _bad(f"{path}: row {row}: {text_key!r} is not UTF-8 text (invalid byte at offset {text.start})",
                         skip)
                elif text:
                    yield text
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file after row {row} ({exc})") from exc


_END = object()


class _Abandoned(Exception):
    """The reader's consumer has gone: the reading thread stops."""


def read_ahead(sources: Sequence[tuple[Path, str, BadDocuments | None]], *, chunk: int = 256,
               depth: int = 8) -> Iterator[tuple[int, list[str] | None]]:
    """The documents of ``sources`` ((path, text_key, skip) each), read by a second thread while
    the caller works (the tokenizer releases the GIL): ``(k, documents)`` chunks of source k in
    order, then ``(k, None)`` when source k is read to its end. A source that cannot be read raises
    its DataError here, after every chunk before it. At most ``depth`` chunks are held."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> None:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Abandoned

    def read() -> None:
        try:
            for k, (path, text_key, skip) in enumerate(sources):
                docs: list[str] = []
                for doc in iter_documents(path, text_key=text_key, skip=skip):
                    docs.append(doc)
                    if len(docs) == chunk:
                        put((k, docs))
                        docs = []
                if docs:
                    put((k, docs))
                put((k, None))
            put(_END)
        except _Abandoned:
            return
        except BaseException as exc:  # handed to the consumer, in order
            with contextlib.suppress(_Abandoned):
                put(exc)

    thread = threading.Thread(target=read, name="lmtrain-read-ahead", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=2.0)  # a daemon: a stop (SIGTERM) is not held up by a long read


def _texts(column: Any) -> list[Any]:
    """A batch's strings; a row whose bytes are not UTF-8 (parquet does not check them) is its
    UnicodeDecodeError, the rows around it still read."""
    try:
        return list(column.to_pylist())
    except UnicodeDecodeError:
        pass
    out: list[Any] = []
    for i in range(len(column)):
        try:
            out.append(column[i].as_py())
        except UnicodeDecodeError as exc:
            out.append(exc)
    return out


@dataclass(frozen=True)
class ShardJob:
    """What one shard is made of: input file ``source`` tokenized into shard ``index`` by the
    preparation whose :meth:`Preparation.recipe` is ``recipe``."""

    index: int
    source: Path
    text_key: str = "text"
    skip_bad: bool = False
    recipe: str = ""


def tokenizer_digest(path: str | None) -> str:
    """What the tokenizer is, by content: "bytes", or the sha256 over the files of its directory
    (name and digest of each), so a tokenizer retrained in the same directory is another one."""
    if path is None:
        return "bytes"
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        h.update(f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Preparation:
    """What a preparation makes: the shards of ``files`` (one each, in order) with ``tokenizer``."""

    files: list[Path]
    tokenizer: str | None
    text_key: str = "text"
    skip_bad: bool = False

    @functools.cached_property
    def recipe(self) -> str:
        """The digest of how each document becomes ids (the tokenizer's content, the text field,
        --skip-bad): a shard's record carries it, and a shard written by another recipe is not
        finished for this one (a preparation resubmitted with another tokenizer redoes them)."""
        what = {"tokenizer": tokenizer_digest(self.tokenizer), "text_key": self.text_key, "skip_bad": self.skip_bad}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def jobs(self) -> list[ShardJob]:
        return [ShardJob(i, f, self.text_key, self.skip_bad, self.recipe) for i, f in enumerate(self.files)]

    def to_json(self) -> dict[str, Any]:
        return {"files": [str(f.absolute()) for f in self.files], "tokenizer": self.tokenizer,
                "text_key": self.text_key, "skip_bad": self.skip_bad}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Preparation:
        return cls([Path(f) for f in d["files"]], d["tokenizer"], d["text_key"], bool(d["skip_bad"]))
