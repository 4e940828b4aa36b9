"""A checkpoint's large files uploaded while they are being written (lmcore.objects.upload_process).

A checkpoint is written into a temporary directory, renamed to its name, then completed
(lmtrain.checkpoint.completion). Told where that directory is as the save begins, a
:class:`Follower` watches it, opens each file as it appears, reads what the writer has written so
far (the writer only appends, and its pages are still cached: lmtrain.checkpoint.writeback drops
them two chunks behind) and sends every whole part of a multipart upload as soon as it has one, to
the key the checkpoint's upload will give the file. When the checkpoint is complete and its upload
starts (:meth:`CheckpointStore.upload` with this follower's token), :meth:`Follower.finish` sends
the rest of each file and completes it, but only when the file under the checkpoint's name is the
very file followed (same inode), every byte was read, and the checksum of the bytes sent is the
manifest's: anything else (a file rewritten, a part refused, a filesystem whose readers lag its
writers) is aborted and uploaded whole from the complete checkpoint, as without a follower. A
file smaller than one part is never started: it is uploaded whole. So the upload of the largest
file ends about when its write does, instead of starting then.

A save that fails removes the temporary directory without renaming it: the follower then aborts
what it started. Retention (``CheckpointStore.retain``) aborts whatever a killed process left.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmcore.objects.checkpoints import PART

PIECE = 8 << 20  # read at most this much at a time, so that the writer's pages are still cached
POLL_S = 0.02
IN_FLIGHT = 3  # parts read and not yet sent, at most (each PART bytes of memory)


class FollowedFile:
    """One file of the checkpoint being written: an open descriptor (renames keep it), the bytes read
    so far and their checksum, and its multipart upload once it has a whole part."""

    def __init__(self, path: Path, rel: str) -> None:
        import xxhash

        self.rel = rel
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)
        self.offset = 0
        self.buffer = bytearray()
        self.hasher = xxhash.xxh3_128()
        self.upload_id: str | None = None
        self.parts: list[Future[dict[str, Any]]] = []
        self.failed = False


class Follower:
    """Follows the checkpoint ``name`` written in ``tmp`` (renamed to ``final`` when whole)."""

    def __init__(self, store: Any, tmp: Path, final: Path, name: str, token: str) -> None:
        self.store, self.tmp, self.final, self.name, self.token = store, tmp, final, name, token
        self.files: dict[str, FollowedFile] = {}
        self.pool = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="follow")
        self.room = threading.BoundedSemaphore(IN_FLIGHT)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"follow-{name}", daemon=True)
        self.thread.start()

    # --- while the checkpoint is written -------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopped.is_set() and self.tmp.is_dir():
            self._scan()
            for f in list(self.files.values()):
                self._advance(f, last=False)
            time.sleep(POLL_S)
        if not self.stopped.is_set() and not self.final.is_dir():  # the save failed: nothing will complete
            self.close()

    def _scan(self) -> None:
        try:
            paths = [p for p in self.tmp.rglob("*") if not p.name.startswith(".") and p.is_file()]
        except OSError:  # renamed or removed while listed
            return
        for path in paths:
            rel = path.relative_to(self.tmp).as_posix()
            if rel not in self.files:
                try:
                    self.files[rel] = FollowedFile(path, rel)
                except OSError:
                    continue

    def _advance(self, f: FollowedFile, *, last: bool) -> None:
        if f.failed:
            return
        size = os.fstat(f.fd).st_size
        while f.offset < size and not f.failed:
            piece = os.pread(f.fd, min(PIECE, size - f.offset), f.offset)
            if not piece:
                break
            f.hasher.update(piece)
            f.buffer += piece
            f.offset += len(piece)
            if len(f.buffer) >= PART:
                self._send(f, bytes(f.buffer[:PART]))
                del f.buffer[:PART]
        if last and f.upload_id is not None and f.buffer and not f.failed:
            self._send(f, bytes(f.buffer))
            f.buffer.clear()

    def _send(self, f: FollowedFile, data: bytes) -> None:
        client, bucket, key = self.store.client, self.store.url.bucket, self.store.file_key(self.name, self.token, f.rel)
        try:
            if f.upload_id is None:
                f.upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        except Exception:  # the whole file goes up from the complete checkpoint instead
            f.failed = True
            return
        number, upload_id = len(f.parts) + 1, f.upload_id
        self.room.acquire()

        def part() -> dict[str, Any]:
            try:
                got = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)
                return {"ETag": got["ETag"], "PartNumber": number}
            finally:
                self.room.release()

        f.parts.append(self.pool.submit(part))

    # --- once the checkpoint is complete ---------------------------------------------------------------
    def finish(self, rel: str, path: Path, key: str, digest: str) -> bool:
        """Complete the followed upload of ``rel`` (now ``path``) to ``key``: whether it is there, whole
        and verified; False: the caller uploads the file whole."""
        self.stopped.set()
        self.thread.join()
        f = self.files.get(rel)
        if f is None or f.upload_id is None or key != self.store.file_key(self.name, self.token, rel):
            return False
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) != f.ident:
                raise ValueError("not the file followed")
            self._advance(f, last=True)
            parts = [p.result() for p in f.parts]
            if f.failed or f.offset != st.st_size or f.hasher.hexdigest() != digest:
                raise ValueError("not the bytes written")
            self.store.client.complete_multipart_upload(Bucket=self.store.url.bucket, Key=key, UploadId=f.upload_id,
                                                        MultipartUpload={"Parts": parts})
        except Exception:
            self._abort(f)
            return False
        f.upload_id = None  # complete: nothing to abort
        return True

    def _abort(self, f: FollowedFile) -> None:
        f.failed = True
        for p in f.parts:  # none of them still sending when the upload is aborted
            try:
                p.result()
            except Exception:
                pass
        if f.upload_id is not None:
            upload_id, f.upload_id = f.upload_id, None
            try:
                self.store.client.abort_multipart_upload(Bucket=self.store.url.bucket,
                                                         Key=self.store.file_key(self.name, self.token, f.rel),
                                                         UploadId=upload_id)
            except Exception:  # retention aborts it later
                pass

    def close(self) -> None:
        """Stop following; abort every upload not completed; close the files."""
        self.stopped.set()
        if threading.current_thread() is not self.thread:
            self.thread.join()
        for f in list(self.files.values()):
            self._abort(f)
            os.close(f.fd)
        self.files.clear()
        self.pool.shutdown(wait=True)
