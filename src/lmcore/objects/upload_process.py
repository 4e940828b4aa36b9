"""Checkpoint uploads from a process of their own: the uploading side of a training rank.

A training rank that keeps its checkpoints in a bucket (lmtrain.checkpoint.store_mirror) uploads them
while it trains, from a child process started with the rank and fed one request at a time over a
pipe: boto3, its threads and its buffers stay out of the training process, and SLURM's signals do
not cut an upload the rank still waits for. (Measured against the upload from a thread of rank 0,
bench/s3_checkpoint.py: the same speed, 9.2-9.9 s against 9.4-9.6 s a periodic 1.5 GB checkpoint;
on that machine the gateway shares the cores with training and bounds both.)

    rank -> child   {"path": DIR, "name": "step-40", "digests": {...}, "keep_last": 2, "publishers": R}
    child -> rank   {"ok": true, "bytes": N, "seconds": T, "removed": [...], "retention_s": T2
                     [, "retention_error": "..."]}  or  {"ok": false, "error": "..."}
    rank -> child   {"op": "publish", "path": DIR, "final": DIR, "name": "step-40", "rank": 3,
                     "files": {rel: [bytes, xxh3]}}
    child -> rank   {"ok": true, "seconds": T}  or  {"ok": false, "error": "..."}

A ``publish`` (a rank other than 0 of a sharded checkpoint, its own files once written) uploads them
and a marker that lists them (CheckpointStore.publish); rank 0's upload of the complete checkpoint
waits up to :data:`PUBLISH_WAIT_S` for ``publishers`` ranks' markers and uploads only what they did
not (every rank sends its own shards; rank 0 the rest).

``seconds`` is the time to durable (every file and the commit); retention runs after it and its
failure does not make the checkpoint any less complete. The child ignores the signals SLURM sends a
job's processes (the rank decides what a stop means and waits for the upload it needs) and exits as
soon as its stdin closes: when the rank ends it, and when the rank dies, so it never outlives it. The
credentials reach it as the path of their file, never as a value.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lmcore.objects.checkpoints import ObjectStoreError

MODULE = "lmcore.objects.upload_process"
PUBLISH_WAIT_S = 120.0  # the longest rank 0 waits for the other ranks' files before it uploads them itself
_IGNORED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


class UploadProcess:
    """The rank's side: a child that uploads to ``url`` with the credentials file ``credentials``."""

    def __init__(self, url: str, credentials: str | Path) -> None:
        self.url, self.credentials = url, str(credentials)
        self.proc: subprocess.Popen[str] | None = None
        self.writing = threading.Lock()

    def start(self) -> None:
        """Start the child when none is running (it imports boto3 while the rank trains)."""
        with self.writing:
            self._start()

    def _start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the directory that holds lmcore
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        blocked = {getattr(signal, name) for name in _IGNORED}
        was = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # inherited: none lands before the child ignores it
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", MODULE, self.credentials, self.url], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env, close_fds=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, was)

    def _send(self, request: dict[str, Any]) -> subprocess.Popen[str]:
        with self.writing:
            self._start()
            proc = self.proc
            assert proc is not None and proc.stdin is not None
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            return proc

    def upload(self, path: Path, name: str, digests: dict[str, str], keep_last: int, publishers: int = 0) -> dict[str, Any]:
        """Upload ``path`` as ``name`` and apply ``keep_last``; the child's answer (see the module's
        docstring). ObjectStoreError when the child ended before it answered (started again next time)."""
        return self.ask({"path": str(path), "name": name, "digests": digests, "keep_last": keep_last,
                         "publishers": publishers})

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send ``request`` and read its answer (one thread at a time asks)."""
        proc = None
        try:
            proc = self._send(request)
            assert proc.stdout is not None
            line = proc.stdout.readline()
        except (OSError, ValueError):  # a closed pipe: the child is gone
            line = ""
        if not line:
            rc = None if proc is None else proc.poll()
            raise ObjectStoreError(f"{self.url}: the upload process ended before it answered"
                                   f"{'' if rc is None else f' (exit status {rc})'}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self, wait_s: float = 10.0) -> None:
        """End the child: its stdin closed, it exits (an upload under way is abandoned)."""
        with self.writing:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the child ----------------------------------------------------------------------------------------
def _published(store: Any, name: str, publishers: int) -> dict[str, Any]:
    """The files ``publishers`` other ranks uploaded for ``name``, once each rank's marker is there or
    after PUBLISH_WAIT_S (what is missing then is uploaded with the rest)."""
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while True:
        got = store.published(name) if publishers else {}
        if len(got) >= publishers or time.monotonic() > deadline:
            return {rel: entry for entries in got.values() for rel, entry in entries.items()}
        time.sleep(0.2)


def _publish(store: Any, request: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        files = {rel: (int(size), str(digest)) for rel, (size, digest) in request["files"].items()}
        store.publish(Path(request["path"]), request["name"], files, int(request["rank"]),
                      renamed_to=Path(request["final"]) if request.get("final") else None)
    except Exception as exc:  # the rank's files are then uploaded by rank 0 with the checkpoint
        return {"ok": False, "error": str(exc) or type(exc).__name__}
    return {"ok": True, "seconds": time.perf_counter() - t0}


def _answer(store: Any, request: dict[str, Any]) -> dict[str, Any]:
    if request.get("op") == "publish":
        return _publish(store, request)
    t0 = time.perf_counter()
    try:
        reuse = _published(store, request["name"], int(request.get("publishers") or 0))
        commit = store.upload(Path(request["path"]), request["name"], digests=request.get("digests") or {}, reuse=reuse)
    except Exception as exc:  # whatever the client raises costs this upload, never the process
        return {"ok": False, "error": str(exc) or type(exc).__name__}
    out: dict[str, Any] = {"ok": True, "bytes": commit.bytes, "seconds": time.perf_counter() - t0, "removed": []}
    t1 = time.perf_counter()
    try:
        out["removed"] = list(store.retain(int(request["keep_last"])).checkpoints)
    except Exception as exc:
        out["retention_error"] = str(exc) or type(exc).__name__
    out["retention_s"] = time.perf_counter() - t1
    return out


def main(argv: list[str]) -> int:
    for name in _IGNORED:  # blocked since the rank started us (UploadProcess.start); those pending are dropped
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {getattr(signal, name) for name in _IGNORED})
    answers = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    from lmcore.objects.checkpoints import CheckpointStore

    credentials, url = argv
    try:
        store: Any = CheckpointStore.at(url, credentials)
        refused = ""
    except Exception as exc:  # said in every answer: the rank logs it with the step it cost
        store, refused = None, str(exc) or type(exc).__name__
    requests: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            requests.put(json.loads(line))
        os._exit(0)  # stdin closed: the rank ended us or died; an upload under way is abandoned

    threading.Thread(target=read, name="requests", daemon=True).start()
    while True:
        request = requests.get()
        answer = {"ok": False, "error": refused} if store is None else _answer(store, request)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
