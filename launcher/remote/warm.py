"""A warm lmlaunch on the login node answers the read-only commands a workstation forwards.

`lmlaunch --remote P status` runs lmlaunch on the login node over ssh: one Python start and the
CLI's imports there, on top of the workstation's own. The exporter (`metrics serve`) and the web
page (`dashboard`) are long-lived lmlaunch processes on that node already, with those modules
imported: while one runs it also listens on a Unix socket in the user's lmlaunch home
(``$LMLAUNCH_HOME/warm/cli.sock``, the directory 0700, the peer's uid checked) and answers
``status``, ``history`` and ``logs`` (not ``--follow``) there, in-process. The forwarded
command (launcher.remote.forward) asks the socket first with :data:`CLIENT`, a few lines of stdlib
Python started with ``-S`` (no site, a few milliseconds), and runs lmlaunch as before whenever the
socket is missing, refuses or fails (exit :data:`FALL_BACK`).

The answer is the command's own: the same ``launcher.cli.main`` with the same arguments, its
output captured; only read-only commands, and only for a client whose cluster settings (SLURM_CONF,
the runs root, the local cluster) are the server's, so that it reads the same runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from launcher.runs.home import lmlaunch_home

ANSWERS = frozenset({"status", "history", "logs"})  # read-only, answered whole (no --follow/--watch)
STREAMING = frozenset({"-f", "--follow", "--watch", "-w"})
PASSED = ("COLUMNS", "LINES", "NO_COLOR", "TERM", "LMLAUNCH_FORWARDED")  # what changes only the rendering
SAME = ("SLURM_CONF", "LMLAUNCH_RUNS_ROOT", "LMLAUNCH_CLUSTER_DIR", "LMLAUNCH_REMOTE")  # must equal the server's
FALL_BACK = 254  # the client's exit when the warm process cannot answer: run lmlaunch as before
MAX_REQUEST = 1 << 20

# The client the forwarded command runs (python -S -c CLIENT SOCKET ARGS...): stdlib only.
CLIENT = (
    "import json,os,socket,sys\n"
    "try:\n"
    " s=socket.socket(socket.AF_UNIX);s.settimeout(60);s.connect(sys.argv[1])\n"
    f" e={{k:os.environ[k] for k in {PASSED + SAME!r} if k in os.environ}}\n"
    " t=sys.stdout.isatty()\n"
    " if t:\n"
    "  try:z=os.get_terminal_size();e.setdefault('COLUMNS',str(z.columns));e.setdefault('LINES',str(z.lines))\n"
    "  except OSError:pass\n"
    " s.sendall(json.dumps({'argv':sys.argv[2:],'env':e,'tty':t}).encode()+b'\\n');s.shutdown(socket.SHUT_WR)\n"
    " b=b''\n"
    " while True:\n"
    "  c=s.recv(65536)\n"
    "  if not c:break\n"
    "  b+=c\n"
    " r=json.loads(b)\n"
    f" if r.get('refused'):sys.exit({FALL_BACK})\n"
    "except (OSError,ValueError):\n"
    f" sys.exit({FALL_BACK})\n"
    "sys.stdout.write(r['out']);sys.stdout.flush();sys.stderr.write(r['err']);sys.exit(r['code'])\n"
)


def socket_path(environ: dict[str, str]) -> Path:
    return lmlaunch_home(environ) / "warm" / "cli.sock"


def answers(argv: list[str]) -> bool:
    """Whether the warm process answers this command line (read-only and whole)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in ANSWERS and not any(a in STREAMING or a.startswith("--follow=") for a in argv)


def remote_command(python: str, fallback: str, args: list[str], env: list[str]) -> str:
    """The login shell's side of a forwarded read-only command: the warm process's answer through
    :data:`CLIENT` (with ``env``'s NAME=VALUE set, as the fallback has them), else ``fallback``
    (the command as it ran before)."""
    sock = '"${LMLAUNCH_HOME:-$HOME/.lmlaunch}/warm/cli.sock"'
    quoted = " ".join(shlex.quote(a) for a in args)
    return (f"if [ -S {sock} ]; then env {' '.join(env)} {python} -S -c {shlex.quote(CLIENT)} {sock} {quoted}; "
            f"r=$?; [ $r -ne {FALL_BACK} ] && exit $r; fi; {fallback}")


class Answering:
    """The Unix socket served from a thread while a long-lived lmlaunch runs (a context manager)."""

    def __init__(self, environ: dict[str, str] | None, entry: Callable[[list[str], Any], int] | None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.entry = entry  # launcher.cli.main (Context.entry); None: nothing to answer with
        self.path = socket_path(self.environ)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one command at a time: the CLI's modules keep module state

    def __enter__(self) -> Answering:
        if self.entry is None:
            return self
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path.parent, 0o700)
            if self.path.is_socket() and not _alive(self.path):
                self.path.unlink()  # a crashed server's
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self.path))
            sock.listen(16)
        except OSError:
            return self  # another warm process answers already, or the home is not writable: no harm
        self._sock = sock
        threading.Thread(target=self._serve, name="lmlaunch-warm", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _serve(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                reply = self.reply(conn, _peer_uid(conn))
                conn.sendall(json.dumps(reply).encode())
            except (OSError, ValueError):
                pass

    def reply(self, conn: socket.socket, uid: int | None) -> dict[str, object]:
        if uid != os.getuid():
            return {"refused": "another user"}
        data = b""
        while len(data) < MAX_REQUEST and (chunk := conn.recv(65536)):
            data += chunk
        request = json.loads(data)
        argv, env = request.get("argv"), request.get("env")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or not isinstance(env, dict):
            return {"refused": "malformed"}
        if not answers(argv) or any(env.get(k) != self.environ.get(k) for k in SAME):
            return {"refused": "not this process's to answer"}
        return self.run(argv, {k: str(env[k]) for k in PASSED if k in env}, tty=request.get("tty") is True)

    def run(self, argv: list[str], passed: dict[str, str], *, tty: bool = False) -> dict[str, object]:
        """The command's answer, rendered as it would be for the client's terminal (``tty``: colours
        and the width the client passed) or pipe."""
        from launcher.context import Context

        assert self.entry is not None
        out, err = (_Terminal(), _Terminal()) if tty else (io.StringIO(), io.StringIO())
        environ = {**{k: v for k, v in self.environ.items() if k not in PASSED}, **passed}
        with self._lock:
            code = self.entry(argv, Context(stdout=out, stderr=err, environ=environ, entry=self.entry))
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


@contextlib.contextmanager
def answering(ctx: Any) -> Iterator[Answering]:
    """While a long-lived command serves (``ctx``: its launcher.context.Context)."""
    with Answering(ctx.environ or None, ctx.entry) as server:
        yield server


class _Terminal(io.StringIO):
    """Captured output rendered for a terminal (the client's stdout is one)."""

    def isatty(self) -> bool:
        return True


def _alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
            return True
        except OSError:
            return False


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return int(struct.unpack("3i", creds)[1])
