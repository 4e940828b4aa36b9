"""Rank 0's last part of every save, and retention (torch-free): the step directory made complete.

:class:`lmtrain.checkpoint.manager.CheckpointManager` (every strategy) and the scale harness's tiny
shards (lmtrain.simulate.shards) both end a save here, once every rank's part is written: the
protocol is the module docstring of lmtrain.checkpoint.manager, steps 3 and the pruning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import (
    COMPLETE_NAME,
    LATEST_NAME,
    STEP_RE,
    complete_checkpoints,
    is_temporary_dir_name,
)
from lmtrain import faults
from lmtrain.checkpoint import checksums
from lmtrain.checkpoint.disk_space import is_no_space
from lmtrain.checkpoint.durable import all_files, fsync_dir, fsync_file, manifest, remove_tree, write_text_atomic

log = logging.getLogger("lmtrain.checkpoint.manager")

FORMAT_VERSION = 1
RESERVE_DIR_NAME = ".staging-reserve.tmp"  # lmtrain.checkpoint.async_sharded's reserve_zero scratch (removed at once; leftovers here)
UNIVERSAL_PREFIX = "universal-"  # lmtrain.checkpoint.elastic: a ZeRO checkpoint's universal form beside it


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from as things are (the message says what to do)."""


def finish(ckpt_dir: Path, tmp: Path, final: Path, step: int, meta: dict[str, Any]) -> None:
    """Rank 0, every rank's part written: make ``tmp`` the complete checkpoint ``final``
    (``meta``: meta.json's fields beside format, step and time), then point ``latest`` at it."""
    for path in all_files(tmp):
        fsync_file(path)
    meta = {"format": FORMAT_VERSION, "step": step, **meta, "time": time.time()}
    write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=2, sort_keys=True))
    reported = checksums.collect(tmp)  # every rank's files' checksums (and the sidecars gone)
    fsync_dir(tmp)
    os.replace(tmp, final)
    faults.point("checkpoint.dir_renamed", file=final.name)
    fsync_dir(ckpt_dir)
    files = manifest(final)
    sums = checksums.for_manifest(final, files, reported)
    write_text_atomic(final / COMPLETE_NAME, json.dumps({"step": step, "files": files, "checksums": sums}) + "\n")
    checksums.forget()
    # complete (and durable) from here: `latest` (a hint) and pruning are housekeeping; no room there costs nothing
    try:
        write_text_atomic(ckpt_dir / LATEST_NAME, f"{final.name}\n")
    except OSError as exc:
        if not is_no_space(exc):
            raise
        log.error("checkpoint %s is complete, but `latest` could not be updated: %s", final.name, exc)


def prune(ckpt_dir: Path, keep_last: int, keep_also: Callable[[list[int]], set[int]] | None = None) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (and those ``keep_also`` names); drop
    stale temporaries."""
    complete = complete_checkpoints(ckpt_dir)
    also = keep_also([c.step for c in complete]) if keep_also is not None else set()
    for old in complete[: max(0, len(complete) - keep_last)]:
        if old.step not in also:
            remove_tree(old.path)
    complete = [c for c in complete if c.path.is_dir()]
    newest = complete[-1].step if complete else -1
    kept = {c.path.name for c in complete}
    for child in ckpt_dir.iterdir():
        m = STEP_RE.fullmatch(child.name)
        if m and int(m.group(1)) < newest and child.name not in kept and child.is_dir():
            remove_tree(child)  # an interrupted write or deletion, superseded
        elif is_temporary_dir_name(child.name):
            shutil.rmtree(child, ignore_errors=True)  # an interrupted write (never complete)
        elif child.name == RESERVE_DIR_NAME:
            shutil.rmtree(child, ignore_errors=True)  # an interrupted reservation's scratch
        elif child.name.startswith(".trash-"):
            shutil.rmtree(child, ignore_errors=True)  # an interrupted deletion
        elif child.name.startswith(f".{LATEST_NAME}.tmp-"):
            child.unlink(missing_ok=True)  # an interrupted pointer update
        elif child.name.startswith(UNIVERSAL_PREFIX) and not (ckpt_dir / child.name[len(UNIVERSAL_PREFIX):]).exists():
            shutil.rmtree(child, ignore_errors=True)  # the universal form of a pruned checkpoint
        elif child.name.startswith(f".{UNIVERSAL_PREFIX}") and child.name.endswith(".tmp"):
            shutil.rmtree(child, ignore_errors=True)  # an interrupted conversion
        elif child.name.startswith(f".{UNIVERSAL_PREFIX}") and child.name.endswith(".error"):
            child.unlink(missing_ok=True)  # why an old conversion failed
