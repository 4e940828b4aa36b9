"""Atomic file writes: a reader sees the old file or the new one, never half of one. The one
writer of whole small files in a run directory (markers, JSON records, answers published to
other ranks); checkpoint files go through :mod:`lmtrain.checkpoint.durable`, which adds its
fault-injection points and checksums.

``write_private``: nobody but the owner can read the file (mode 0600 from creation, not
chmod-ed after). ``durable``: the file and its directory are fsynced, so the new content
survives a crash of the node as well as of the process.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, text: str, *, mode: int = 0o644, durable: bool = False) -> None:
    """Write ``text`` to a temporary file beside ``path`` (named for this process, so two
    writers never share one) and rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _drop_abandoned(path)
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


ABANDONED_S = 120.0  # a temporary file this old was left by a writer killed between write and rename


def _drop_abandoned(path: Path) -> None:
    """Remove temporary files of ``path`` that writers killed mid-write left behind (a chaos campaign
    found one in a run's metrics/). By age, not by pid: on a shared filesystem the writer may be a
    process of another node; a live one renames its file within milliseconds."""
    import time

    now = time.time()
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if now - stale.stat().st_mtime > ABANDONED_S:
                stale.unlink()
        except OSError:
            continue


ABANDONED_NAME = re.compile(r"\..+\.\d+\.tmp")  # write_atomic's temporary: .NAME.PID.tmp


def drop_abandoned_under(root: str | Path, before: float, *, skip: tuple[str, ...] = ()) -> list[Path]:
    """Temporary files of :func:`write_atomic` under ``root`` last changed before ``before`` (epoch
    seconds): left by writers killed between write and rename, when every writer of that time is
    known gone (an attempt starting after the one before it ended: its processes are). Removed; those
    that were. ``skip``: directory names not looked into (the checkpoints have their own protocol)."""
    root = Path(root)
    removed = []
    for stale in root.rglob(".*.tmp"):
        if not ABANDONED_NAME.fullmatch(stale.name) or skip and set(stale.relative_to(root).parts[:-1]) & set(skip):
            continue
        try:
            if stale.is_file() and stale.stat().st_mtime < before:
                stale.unlink()
                removed.append(stale)
        except OSError:
            continue
    return removed


def write_private(path: str | Path, text: str) -> None:
    """:func:`write_atomic`, readable by the owner only."""
    write_atomic(path, text, mode=0o600)


def write_json(path: str | Path, obj: Any, *, mode: int = 0o644, durable: bool = False) -> None:
    """One JSON document and a newline, written atomically."""
    write_atomic(path, json.dumps(obj) + "\n", mode=mode, durable=durable)
