"""Checksums of a checkpoint's files, computed while each file is written.

Every large file of a checkpoint goes through a :class:`lmtrain.checkpoint.writeback.WritebackStream`
(``save_streamed``: DDP's Lightning file, DeepSpeed's shards, FSDP2's DCP files, ``meta.pt``), which
hashes the bytes as they pass (:func:`new_hasher`; lmcore.run.checkpoint_index names the
algorithm) and reports ``(path, size, digest)`` here when the file is whole (:func:`record`). The
small files lmtrain writes itself (``rank-R.pt``, ``meta.json``) are hashed once written
(lmtrain.checkpoint.durable). So no file is read back for its checksum.

Each rank knows only the files it wrote. At the end of its part of a save it writes them into
the checkpoint's temporary directory as ``.sums-rank-R.json`` (:func:`write_sidecar`); rank 0,
completing the checkpoint, merges every rank's with its own (:func:`collect`), hashes what nobody
reported (a file a library wrote by other means), and puts them into COMPLETE's manifest beside
the sizes. Loading verifies them (lmtrain.checkpoint.resume_point).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from lmcore.atomic import write_private
from lmcore.digests import file_digest
from lmcore.run.checkpoint_index import CHECKSUM_ALGORITHM

SIDECAR_PREFIX = ".sums-rank-"
_lock = threading.Lock()
_written: dict[Path, tuple[int, str]] = {}  # this process's files: absolute path -> (size, digest)


def new_hasher() -> Any:
    import xxhash

    assert CHECKSUM_ALGORITHM == "xxh3_128"
    return xxhash.xxh3_128()


def record(path: str | os.PathLike[str], size: int, digest: str) -> None:
    """A file this process wrote whole: its size and checksum (the last write of a path wins)."""
    with _lock:
        _written[Path(path).absolute()] = (size, digest)


def record_file(path: Path) -> None:
    """Hash a small file just written (it is in the page cache) and record it."""
    record(path, path.stat().st_size, file_digest(path))


def forget(keep: Path | None = None) -> None:
    """Drop what was recorded, but the files under ``keep`` (a save starting: older ones are done)."""
    with _lock:
        for path in [p for p in _written if keep is None or not p.is_relative_to(keep.absolute())]:
            del _written[path]


def written_under(root: Path) -> dict[str, tuple[int, str]]:
    """The files this process wrote under ``root``: relative path -> (size, digest)."""
    root = root.absolute()
    with _lock:
        return {p.relative_to(root).as_posix(): w for p, w in _written.items() if p.is_relative_to(root)}


def _under(root: Path) -> dict[str, str]:
    return {rel: digest for rel, (_size, digest) in written_under(root).items()}


def write_sidecar(root: Path, rank: int) -> None:
    """This rank's checksums of the files it wrote under ``root`` (a checkpoint being written),
    for rank 0 to merge: ``root/.sums-rank-R.json`` (tmp + rename; rank 0 fsyncs the directory)."""
    write_private(root / f"{SIDECAR_PREFIX}{rank}.json",
                  json.dumps({"algorithm": CHECKSUM_ALGORITHM, "files": _under(root)}))


def collect(root: Path) -> dict[str, str]:
    """Rank 0, every rank's part written: every rank's sidecar under ``root`` merged with this
    process's own records (relative path -> digest); the sidecars are removed."""
    out: dict[str, str] = {}
    for side in sorted(root.glob(f"{SIDECAR_PREFIX}*.json")):
        data = json.loads(side.read_text())
        if data.get("algorithm") == CHECKSUM_ALGORITHM:
            out.update(data.get("files") or {})
        side.unlink()
    out.update(_under(root))
    return out


def for_manifest(root: Path, files: dict[str, int], reported: dict[str, str]) -> dict[str, Any]:
    """COMPLETE's ``checksums`` for the manifest ``files`` of ``root``: the reported digests, and
    the few files nobody reported hashed now."""
    sums = {rel: reported[rel] if rel in reported else file_digest(root / rel) for rel in files}
    return {"algorithm": CHECKSUM_ALGORITHM, "files": sums}
