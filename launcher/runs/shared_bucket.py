"""Whether a move between clusters must copy the run's checkpoint (launcher.submit.mover): not when
its checkpoints are in a bucket (``checkpoint.dir: s3://...``) that every cluster of the run reads and
that bucket holds the newest complete checkpoint of the cluster the run leaves, or a newer one. The
attempt on the other cluster then downloads it, verified, before it resumes
(lmtrain.checkpoint.store_mirror.fetch_newer).

A bucket that lacks it (its upload failed or was cut: the gateway was down when the attempt ended),
that cannot be listed from here, or whose credentials this machine cannot read: the checkpoint is
copied over SSH as for a run without a bucket, and the reason is said."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.errors import UserError
from lmcore.run.run_layout import RunLayout


@dataclass(frozen=True)
class BucketAnswer:
    name: str | None  # the bucket's checkpoint the move relies on; None: the checkpoint is copied
    said: str  # why, for the mover's log and the ledger's ``moved`` line


def _credentials_here(run_dir: Path, dest_plan: Any) -> str | None:
    """A credentials file this machine can read: the run's last plan's (the cluster it leaves), else the
    destination plan's (both name files on the nodes; a cluster reached from here shares this machine's)."""
    try:
        last = json.loads(RunLayout.of(run_dir).plan.read_text())["paths"].get("checkpoint_store_credentials")
    except (OSError, ValueError, KeyError, AttributeError):
        last = None
    for path in (last, dest_plan.paths.checkpoint_store_credentials):
        if path and Path(path).is_file():
            return str(path)
    return None


def holds_newest(run_dir: Path, dest_plan: Any, newest: str | None) -> BucketAnswer:
    """Whether the run's bucket holds ``newest`` (the leaving cluster's newest complete checkpoint, by
    name) or a newer one; the answer for a run without a bucket is that the checkpoint is copied."""
    store_url = dest_plan.paths.checkpoint_store
    if not store_url:
        return BucketAnswer(None, "")
    creds = _credentials_here(run_dir, dest_plan)
    if creds is None:
        return BucketAnswer(None, f"the credentials of {store_url} cannot be read here: its checkpoint is copied")
    from lmcore.objects.checkpoints import CheckpointStore, ObjectStoreError, step_of

    try:
        complete = CheckpointStore.at(store_url, creds).complete()
    except (ObjectStoreError, UserError, OSError) as exc:
        return BucketAnswer(None, f"cannot list {store_url} ({exc}): its checkpoint is copied")
    wanted = step_of(newest) if newest else 0
    held = [n for n in complete if step_of(n) >= wanted]
    if not held:
        return BucketAnswer(None, f"{store_url} lacks {newest or 'any checkpoint'} (its upload did not end): "
                                  "its checkpoint is copied")
    return BucketAnswer(held[-1], f"checkpoint {held[-1]} is in {store_url}, which both clusters read: not copied")
