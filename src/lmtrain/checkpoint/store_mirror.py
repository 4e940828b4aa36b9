"""Complete checkpoints kept in a bucket too (``checkpoint.dir: s3://...``; lmcore.objects.checkpoints).

Every checkpoint is written and completed in the run directory's ``checkpoints/`` as always (the
staged save holds training only for the copy into host memory); rank 0 then uploads each complete
one, one at a time, newest first when several wait, and applies ``keep_last`` to the bucket after
each commit: a thread of rank 0 hands each upload to a process of its own
(lmcore.objects.upload_process), which SLURM's signals leave be and which ends with the rank; the
other ranks of a sharded checkpoint send the files they wrote themselves (:class:`Publisher`).
Training never waits for an upload: a gateway that is down or slow costs the uploads, which are
logged and retried with the next checkpoint, never counted as checkpoints (the bucket's are complete
only by their commit). Local retention keeps a checkpoint until it is in the bucket. An attempt ends
only once the newest complete checkpoint is uploaded or :data:`END_WAIT_S` passed (said in the log).
Before an attempt resumes, rank 0 compares the bucket's newest complete checkpoint with the disk's
and downloads it, verified, when it is newer (a run moved to another cluster, a disk that lost its
files).

The credentials are read from the file the profile names (mode 600, lmcore.objects.credentials):
never from the plan, the environment or a command line, and never logged.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import CHECKSUM_ALGORITHM, COMPLETE_NAME, STEP_RE, complete_checkpoints

log = logging.getLogger(__name__)

END_WAIT_S = 600.0  # the longest an attempt's end waits for its newest checkpoint's upload


class StoreMirror:
    """Rank 0's uploads of complete checkpoints to ``plan.paths.checkpoint_store``."""

    def __init__(self, plan: Any, keep_last: int, publishers: int = 0) -> None:
        from lmcore.objects.checkpoints import CheckpointStore
        from lmcore.objects.upload_process import UploadProcess

        self.store = CheckpointStore.at(plan.paths.checkpoint_store, plan.paths.checkpoint_store_credentials)
        self.url = self.store.url
        self.uploader = UploadProcess(str(self.url), plan.paths.checkpoint_store_credentials)
        self.uploader.start()  # its imports while training starts, not on the first upload's time
        self.keep_last = keep_last
        self.publishers = publishers  # other ranks that upload their own files (Publisher): waited for
        self.waiting: queue.Queue[Path | None] = queue.Queue()
        self.pending: set[int] = set()  # steps queued or uploading: local retention keeps them
        self.failed: dict[int, str] = {}
        self.completed_at: dict[int, float] = {}  # when each step queued was complete on disk
        self.newest: int | None = None  # the newest step queued: what the attempt's end line says of it
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    # --- uploads ------------------------------------------------------------------------------------
    def submit(self, path: Path) -> None:
        """Queue the complete checkpoint ``path`` (rank 0, when it completes)."""
        if not STEP_RE.fullmatch(path.name):
            return
        with self.lock:
            self.pending.add(_step(path))
            self.newest = max(self.newest or 0, _step(path))
            self.completed_at[_step(path)] = time.perf_counter()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="lmtrain-store-upload", daemon=True)
            self.thread.start()
        self.waiting.put(path)

    def kept(self, steps: list[int]) -> set[int]:
        """The steps local retention must keep: those not yet in the bucket."""
        with self.lock:
            return {s for s in steps if s in self.pending}

    def catch_up(self, ckpt_dir: str | Path) -> None:
        """At the attempt's start: the disk's newest complete checkpoint queued when the bucket lacks it
        (an attempt that ended before its upload did)."""
        from lmcore.objects.checkpoints import ObjectStoreError

        local = complete_checkpoints(ckpt_dir)
        try:
            there = set(self.store.complete())
        except (ObjectStoreError, OSError) as exc:
            log.warning("cannot list %s (%s): the next checkpoint's upload tries again", self.url, exc)
            return
        if local and local[-1].path.name not in there:
            self.submit(local[-1].path)

    def _run(self) -> None:
        stop = False
        while not stop:
            got = [self.waiting.get(), *self._drain()]
            stop = None in got
            paths = sorted((p for p in got if p is not None), key=_step)
            for p in paths[:-1]:  # only the newest of those waiting: the others are superseded
                self._done(p, None)
            if paths:
                self._upload(paths[-1])

    def _drain(self) -> list[Path | None]:
        out: list[Path | None] = []
        while True:
            try:
                out.append(self.waiting.get_nowait())
            except queue.Empty:
                return out

    def _upload(self, path: Path) -> None:
        try:
            got = self.uploader.upload(path, path.name, _manifest_digests(path), self.keep_last, self.publishers)
        except Exception as exc:  # whatever goes wrong costs this upload, never the thread
            got = {"ok": False, "error": str(exc) or type(exc).__name__}
        if not got.get("ok"):
            log.warning("checkpoint %s: not uploaded to %s (%s); training goes on, the next checkpoint tries again",
                        path.name, self.url, got.get("error"))
            self._done(path, str(got.get("error")))
            return
        removed = got.get("removed") or []
        with self.lock:
            after = time.perf_counter() - self.completed_at.get(_step(path), time.perf_counter() - got["seconds"])
        log.info("checkpoint %s: in %s (%.2f GB; %.1fs after it was complete on disk, %.1fs of them this upload's%s)",
                 path.name, self.url, got["bytes"] / 1e9, after, got["seconds"],
                 f"; removed there: {', '.join(removed)}" if removed else "")
        if got.get("retention_error"):
            log.warning("%s: keep_last not applied (%s); the next checkpoint's upload tries again", self.url,
                        got["retention_error"])
        self._done(path, None)

    def _done(self, path: Path, error: str | None) -> None:
        step = _step(path)
        with self.lock:
            self.pending.discard(step)
            self.completed_at.pop(step, None)
            if error is not None:
                self.failed[step] = error

    def close(self, wait_s: float = END_WAIT_S) -> bool:
        """At the attempt's end: wait up to ``wait_s`` for the uploads queued; whether they all ended.
        The upload process ends with them (or, when they did not, with this process)."""
        if self.thread is None:
            self.uploader.close()
            return True
        self.waiting.put(None)
        self.thread.join(wait_s)
        if self.thread.is_alive():
            log.warning("the upload to %s did not end within %.0fs: the bucket's newest checkpoint may be older than "
                        "the disk's (the next attempt uploads it)", self.url, wait_s)
            return False
        self.uploader.close()
        return True

    def fate(self) -> dict[str, Any] | None:
        """What became of the newest checkpoint this attempt queued, for the ledger's end line (after
        :meth:`close`): its step, the bucket, and why it is not there when it is not; None: none queued."""
        with self.lock:
            step = self.newest
            if step is None:
                return None
            said: dict[str, Any] = {"step": step, "store": str(self.url), "uploaded": True}
            if step in self.pending:
                said.update(uploaded=False, error=f"still uploading when the attempt ended (after {END_WAIT_S:.0f}s)")
            elif step in self.failed:
                said.update(uploaded=False, error=self.failed[step][:500])
            return said


class Publisher:
    """A rank other than 0 of a sharded checkpoint (FSDP2's DCP files, ZeRO's) kept in a bucket: the files
    it wrote itself, uploaded by its own upload process as soon as its part of a save is written (rank
    0's upload of the complete checkpoint reuses them: lmcore.objects.upload_process), so that every
    rank sends its own shards, in parallel. One save at a time, in order; a failure costs only the
    head start (rank 0 then uploads those files)."""

    def __init__(self, plan: Any, rank: int) -> None:
        from lmcore.objects.upload_process import UploadProcess

        self.rank, self.url = rank, str(plan.paths.checkpoint_store)
        self.uploader = UploadProcess(self.url, plan.paths.checkpoint_store_credentials)
        self.uploader.start()
        self.waiting: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="lmtrain-store-publish", daemon=True)
        self.thread.start()

    def publish(self, tmp: Path, final: Path) -> None:
        """This rank's part of the save being written in ``tmp`` (``final`` once complete) is whole."""
        from lmtrain.checkpoint import checksums

        files = checksums.written_under(tmp)
        if files and STEP_RE.fullmatch(final.name):
            self.waiting.put({"op": "publish", "path": str(tmp), "final": str(final), "name": final.name,
                              "rank": self.rank, "files": {rel: list(sd) for rel, sd in files.items()}})

    def _run(self) -> None:
        while (request := self.waiting.get()) is not None:
            try:
                got = self.uploader.ask(request)
            except Exception as exc:
                got = {"ok": False, "error": str(exc) or type(exc).__name__}
            if got.get("ok"):
                log.info("checkpoint %s: rank %d's %d files in %s (%.1fs)", request["name"], self.rank,
                         len(request["files"]), self.url, got["seconds"])
            else:
                log.warning("checkpoint %s: rank %d's files not uploaded to %s (%s); rank 0 uploads them with the "
                            "checkpoint", request["name"], self.rank, self.url, got.get("error"))

    def close(self, wait_s: float = END_WAIT_S) -> bool:
        """At the attempt's end: wait up to ``wait_s`` for this rank's uploads; whether they ended."""
        self.waiting.put(None)
        self.thread.join(wait_s)
        if self.thread.is_alive():
            log.warning("rank %d's upload to %s did not end within %.0fs: rank 0 uploads its files", self.rank,
                        self.url, wait_s)
            return False
        self.uploader.close()
        return True


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def _manifest_digests(path: Path) -> dict[str, str]:
    """The checksums the checkpoint's COMPLETE already holds (computed as its files were written), so
    that the upload does not read every file once more to compute them; {} when it holds none."""
    try:
        sums = json.loads((path / COMPLETE_NAME).read_text()).get("checksums") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    files = sums.get("files") if sums.get("algorithm") == CHECKSUM_ALGORITHM else None
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def fetch_newer(plan: Any) -> int | None:
    """Rank 0, before it chooses the checkpoint to resume from: the bucket's newest complete checkpoint
    downloaded, verified, when it is newer than the disk's (lmcore.run.bucket_fetch); its step, else None.
    Said on stderr: the attempt's log is not set up yet."""
    if not getattr(plan.paths, "checkpoint_store", None):
        return None
    from lmcore.run.bucket_fetch import fetch

    got = fetch(plan.paths.checkpoint_store, plan.paths.checkpoint_store_credentials, plan.paths.checkpoint_dir)
    if got.step is not None or got.problem:
        print(f"lmtrain: {got.said}", file=sys.stderr, flush=True)
    return got.step
