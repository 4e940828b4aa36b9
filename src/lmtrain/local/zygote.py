"""Local ranks forked from an interpreter that already imported the frameworks.

Every rank of a local launch imports torch, Lightning and transformers before it can train (about 9
CPU-seconds each on a small machine, most of a short run's cost). A zygote is a Python process that
imports them once, then forks each rank from itself: the rank starts with the frameworks loaded and
runs its command (``python -u -m lmtrain.task.entry RUN_DIR`` or a script) as the interpreter would.

- **What may be preloaded.** Only third-party frameworks (:data:`PRELOAD`), never lmtrain or
  launcher: a rank imports those from its own ``PYTHONPATH`` (the run's code snapshot), so the
  code it runs is the code a fresh interpreter would run. The zygote refuses to serve when a
  preload started a thread (fork would copy a process whose other threads are gone) or imported
  lmtrain, launcher or deepspeed.
- **Environment.** A rank's environment may differ from the zygote's only in what nothing
  preloaded reads at import (``MAY_DIFFER``: the rendezvous variables, the snapshot's PYTHONPATH,
  lmtrain's, lmlaunch's and DeepSpeed's own variables, thread counts, which the child applies
  itself; what the zygote's imports set themselves, a rank gets too). Any other difference
  (an ``HF_HOME`` a framework read at import, say) gets a refusal, and the launcher starts that
  rank as a plain process instead. Lightning's rank-zero guard, which reads ``RANK`` at import,
  is set again in the child.
- **Process semantics.** The launcher gets a :class:`Forked` handle with Popen's ``pid``,
  ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` and ``returncode`` (negative for a
  signal); a child ends like an interpreter does (SystemExit's code, 1 after a traceback,
  non-daemon threads joined, atexit handlers run, output flushed).

lmtrain.local.zygote_serve is the zygote (``python -u -P zygote_serve.py SOCKET``, answering on a Unix
socket until its stdin closes); :class:`Zygote` starts one for a launch or connects to a shared one
(``LMTRAIN_ZYGOTE``: the test suite keeps one per worker). No torch import in the launcher's side.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcore.processes import alive
from lmcore.run.rundir import unzipped
from lmtrain.local import zygote_serve
from lmtrain.local.zygote_serve import PRELOAD, SHARED_ENV, START_TIMEOUT_S, differences, forkable

__all__ = ["PRELOAD", "SHARED_ENV", "Forked", "Zygote", "differences", "forkable", "stop"]


# --------------------------------------------------------------------------- the launcher's side


class Forked:
    """A rank forked by the zygote, handled like a ``subprocess.Popen``."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: Any = None
        self._buf = b""
        self._orphan = False

    def _read(self, timeout: float) -> None:
        if self.returncode is not None:
            return
        if self._orphan:  # the zygote is gone: once the rank is gone too, its exit status is unknown
            if not alive(self.pid):
                self.returncode = -signal.SIGKILL
            elif timeout > 0:
                time.sleep(min(timeout, 0.2))
            return
        ready, _, _ = select.select([self._conn], [], [], max(0.0, timeout))
        if not ready:
            return
        chunk = self._conn.recv(4096)
        if not chunk:
            self._orphan = True
            self._conn.close()
            return
        self._buf += chunk
        if b"\n" in self._buf:
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["exit"])
            self._conn.close()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            self._read(min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A connection to a zygote: one started for a launch (:meth:`start`, stopped by :meth:`close`)
    or a shared one (:meth:`shared`)."""

    def __init__(self, path: str, hello: dict, proc: subprocess.Popen | None) -> None:
        self.path = path
        self.env: dict[str, str] = hello["env"]  # what its imports saw
        self.added: dict[str, str] = hello.get("added") or {}  # what its imports set
        self.proc = proc
        self.refusals: list[str] = []

    @classmethod
    def shared(cls) -> Zygote | None:
        """The zygote ``LMTRAIN_ZYGOTE`` names, if it answers (once its imports are done)."""
        path = os.environ.get(SHARED_ENV)
        if not path or path == "off":
            return None
        hello = _hello(path)
        return cls(path, hello, None) if hello is not None else None

    @staticmethod
    def spawn(env: Mapping[str, str], socket_path: str | Path, *, log: Any = None) -> subprocess.Popen:
        """Start a zygote with ``env`` (what its imports see) answering on ``socket_path``; it
        serves until its stdin closes (:func:`stop`). Returns at once: clients that connect
        while it imports wait."""
        # One OpenMP thread while it imports (else an import starts torch's pool, and a process with
        # threads must not fork); each rank sets its own count.
        env = {**{k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONPATH")}, "OMP_NUM_THREADS": "1"}
        Path(socket_path).unlink(missing_ok=True)
        script = str(unzipped(zygote_serve.__file__))  # a file on disk, also when imported from the snapshot's zip
        return subprocess.Popen([sys.executable, "-u", "-P", script, str(socket_path)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log if log is not None else subprocess.DEVNULL, text=True)

    @classmethod
    def start(cls, env: Mapping[str, str], socket_path: str | Path, *, log: Any = None) -> Zygote | None:
        """A zygote of this launch, ready; None when it cannot serve (it says why on ``log``, and
        the launch goes on with plain processes)."""
        path = str(socket_path)
        proc = cls.spawn(env, path, log=log)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        hello = _hello(path) if line.strip() == "ready" else None
        if hello is None:
            stop(proc)
            return None
        return cls(path, hello, proc)

    def fork(self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | Path, stdout: int, stderr: int) -> Forked | None:
        """Fork ``cmd`` with ``env`` in ``cwd``, its output on the given descriptors; None when the
        zygote cannot (the caller starts a plain process)."""
        if forkable(cmd) is None:
            return None
        diff = differences(self.env, env, self.added)
        if "OMP_NUM_THREADS" not in env:  # the rank would take torch's default, which the zygote fixed at 1
            diff.append("OMP_NUM_THREADS (unset)")
        if diff:
            self.refusals.append(f"environment differs in {', '.join(diff[:5])}")
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": list(cmd), "env": dict(env), "cwd": str(cwd)}).encode() + b"\n"
            socket.send_fds(conn, [request], [stdout, stderr])
            answer = _read_line(conn, 30.0)
        except OSError as exc:
            conn.close()
            self.refusals.append(f"zygote unreachable: {exc}")
            return None
        if not answer or "pid" not in answer:
            conn.close()
            self.refusals.append(str((answer or {}).get("refused", "no answer")))
            return None
        return Forked(conn, int(answer["pid"]))

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            Path(self.path).unlink(missing_ok=True)


def stop(proc: subprocess.Popen) -> None:
    """Stop a zygote :meth:`Zygote.spawn` started (its forked ranks run on to their end)."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()  # the zygote's signal to stop serving
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def _hello(path: str) -> dict | None:
    """The zygote's interpreter, environment and what its imports set, once it is ready; None when
    it does not answer or runs another interpreter."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(b'{"hello": true}\n')
            answer = _read_line(s, START_TIMEOUT_S)
    except (OSError, ValueError):
        return None
    if answer is None or answer.get("executable") != sys.executable:
        return None
    return answer


def _read_line(conn: socket.socket, timeout: float) -> dict | None:
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        ready, _, _ = select.select([conn], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])
