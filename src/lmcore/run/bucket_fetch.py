"""A run's checkpoints kept in a bucket too (``checkpoint.dir: s3://...``, lmcore.objects.checkpoints):
one of them brought into the run's checkpoint directory, verified, for whoever reads checkpoints from
disk: an attempt about to resume (its rank 0), ``lmlaunch export``. The download goes to a hidden
directory beside it and takes its step's name only once every file matched its commit's checksum."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lmcore.errors import UserError
from lmcore.run.checkpoint_index import complete_checkpoints


@dataclass(frozen=True)
class Fetched:
    step: int | None  # the checkpoint brought in; None: nothing newer (or that step) in the bucket
    said: str  # what happened, for the log or the user
    problem: bool = False  # the bucket could not be read, or the download failed


def complete_steps(store_url: str, credentials: str | Path) -> list[int]:
    """The steps of the bucket's complete checkpoints, oldest first (``lmlaunch eval`` offers them, its
    evaluator downloads them); the client's errors (ObjectStoreError, UserError, OSError) raised."""
    from lmcore.objects.checkpoints import CheckpointStore, step_of

    return [step_of(n) for n in CheckpointStore.at(store_url, credentials).complete()]


def fetch(store_url: str, credentials: str, ckpt_dir: str | Path, *, step: int | None = None) -> Fetched:
    """The bucket's newest complete checkpoint when it is newer than the disk's newest complete one (or,
    with ``step``, that one when the disk lacks it) downloaded into ``ckpt_dir``. A bucket that cannot
    be read or a download that fails is said, never raised: the disk's checkpoints stay what there is."""
    from lmcore.objects.checkpoints import CheckpointStore, ObjectStoreError, step_of

    try:
        store = CheckpointStore.at(store_url, credentials)
        names = store.complete()
    except (ObjectStoreError, UserError, OSError) as exc:
        return Fetched(None, f"cannot list {store_url} ({exc}): this disk's checkpoints are used", problem=True)
    local = {c.step for c in complete_checkpoints(ckpt_dir)}
    if step is None:
        wanted = [n for n in names if step_of(n) > max(local, default=-1)][-1:]
    else:
        wanted = [n for n in names if step_of(n) == step and step not in local]
    if not wanted:
        return Fetched(None, f"{store_url} holds nothing newer than this disk")
    name, root = wanted[0], Path(ckpt_dir)
    tmp = root / f".{name}.download"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        commit = store.download(name, tmp)
    except (ObjectStoreError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return Fetched(None, f"cannot download {name} from {store_url} ({exc}): this disk's checkpoints are used",
                       problem=True)
    shutil.rmtree(root / name, ignore_errors=True)  # an incomplete one of the same step
    tmp.rename(root / name)
    return Fetched(step_of(name), f"checkpoint {name}: downloaded from {store.url} ({commit.bytes / 1e9:.2f} GB in "
                                  f"{time.perf_counter() - t0:.1f}s, verified), newer than this disk's"
                   if step is None else f"checkpoint {name}: downloaded from {store.url}, verified")
