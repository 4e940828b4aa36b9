"""Durable file writes for checkpoints: fsync, atomic replace, deletion that never leaves a part
looking complete. Every step is a named point of the fault-injection seam (``checkpoint.*``),
where the tests SIGKILL a saving process or make a write find no room.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import COMPLETE_NAME
from lmtrain import faults
from lmtrain.checkpoint import checksums


def _fsync(path: Path, name: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    faults.point("checkpoint.fsync", file=name)


def fsync_dir(path: Path) -> None:
    _fsync(path, path.name)


def fsync_file(path: Path) -> None:
    _fsync(path, path.name)


def _write_atomic(path: Path, mode: str, write: Callable[[Any], None]) -> None:
    """``write(file)`` into a temporary beside ``path``, fsync it, rename it over ``path``, fsync
    the directory (with the kill points the fault-injection tests stop at)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        faults.point("checkpoint.wrote", file=path.name)
        os.fsync(f.fileno())
    faults.point("checkpoint.fsynced", file=path.name)
    os.replace(tmp, path)
    faults.point("checkpoint.renamed", file=path.name)
    fsync_dir(path.parent)
    checksums.record_file(path)  # small, just written: its checksum for a checkpoint's manifest


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, "w", lambda f: f.write(text))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    _write_atomic(path, "wb", lambda f: f.write(data))


def torch_save_atomic(obj: Any, path: Path) -> None:
    import torch  # here: the rest of this module serves the scale harness's ranks, which import no torch

    _write_atomic(path, "wb", lambda f: torch.save(obj, f))


def remove_tree(path: Path) -> None:
    """Delete a directory so that no crash leaves a part of it looking complete: rename it out of
    the ``step-*`` namespace first (atomic), then remove it."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)
    faults.point("checkpoint.removed", file=path.name)


OWN_TEMPORARY = re.compile(r"\..+\.tmp-\d+")  # _write_atomic's names


def manifest(root: Path) -> dict[str, int]:
    """Every file under ``root`` (relative path -> size), but the COMPLETE marker and lmtrain's own
    temporaries. Dot files are listed: FSDP2's DCP directory keeps its index in ``.metadata``."""
    out = {}
    for path in all_files(root):
        rel = path.relative_to(root).as_posix()
        if rel != COMPLETE_NAME and not OWN_TEMPORARY.fullmatch(path.name):
            out[rel] = path.stat().st_size
    return out


def all_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            yield Path(dirpath) / name
