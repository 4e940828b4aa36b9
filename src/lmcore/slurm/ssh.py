"""OpenSSH, the one owner: commands on a cluster's login node over a master connection
(ControlMaster) that the user opened once, so a login that asks for a second factor asks once.

Every connection here reuses the master (``ControlMaster=no``, ``BatchMode=yes``): lmlaunch never
prompts for a password or a code itself. Whether a master is open is asked of ssh
(``ssh -O check``, a few milliseconds, no network); without one, :class:`Connection` gives the
exact command that opens it. The destination may be a Host alias of the user's ``~/.ssh/config``,
whose ProxyJump, port, user and key apply unchanged.
"""

from __future__ import annotations

import shlex
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TextIO

from lmcore.errors import UserError

CHECK_TIMEOUT_S = 5.0  # `ssh -O check` talks to the local socket only
SSH_FAILED = 255  # ssh's own exit status: it could not connect, or the connection dropped


@dataclass(frozen=True)
class Connection:
    destination: str
    control_path: str
    options: tuple[str, ...] = ()  # more ssh arguments (-F FILE, -o NAME=VALUE, ...)

    def _common(self) -> list[str]:
        return [*self.options, "-o", f"ControlPath={self.control_path}"]

    def open_command(self) -> list[str]:
        """What opens the master: in the background, kept until ``ssh -O exit``, asking what the
        login asks (password, second factor) on this terminal."""
        return ["ssh", "-fNM", *self._common(), "-o", "ControlPersist=yes", self.destination]

    def master_alive(self) -> bool:
        try:
            proc = subprocess.run(["ssh", "-O", "check", *self._common(), self.destination], capture_output=True,
                                  timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return proc.returncode == 0

    def open_master(self) -> None:
        """Open the master here, interactively (the login's prompts on this terminal)."""
        try:
            code = subprocess.call(self.open_command())
        except OSError as exc:
            raise UserError(f"ssh could not be started: {exc}") from exc
        if code != 0 or not self.master_alive():
            raise UserError(f"could not open the ssh master connection to {self.destination} "
                            f"(`{shlex.join(self.open_command())}` exited {code})")

    def argv(self, remote_command: str, *, tty: bool = False) -> list[str]:
        """ssh over the master, never prompting; ``remote_command`` is run by the login shell."""
        return ["ssh", *self._common(), "-o", "ControlMaster=no", "-o", "BatchMode=yes",
                "-tt" if tty else "-T", self.destination, remote_command]

    def run(self, remote_command: str, *, stdin: bytes | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[bytes]:
        """Run and collect its stdout and stderr (bytes)."""
        return subprocess.run(self.argv(remote_command), input=stdin, capture_output=True, timeout=timeout)

    def stream(self, remote_command: str, out: TextIO, err: TextIO, *, stdin: bytes | None = None,
               tty: bool = False, passthrough: bool = False, shown: Callable[[str], str] | None = None) -> int:
        """Run, copying its output to ``out``/``err`` as it comes (each line through ``shown``
        where given); returns its exit status (:data:`SSH_FAILED` when the connection failed or
        dropped). ``passthrough``: the child writes to this process's own stdout/stderr (a
        terminal: live displays, Ctrl-C)."""
        if passthrough:
            return subprocess.call(self.argv(remote_command, tty=tty), stdin=None if tty else subprocess.DEVNULL)
        # stdin stays open while this side lives (fed, then left open): the far side sees it close
        # when this process or the connection goes (launcher.remote.forward.ended_with_connection)
        proc = subprocess.Popen(self.argv(remote_command, tty=tty), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        threads = [threading.Thread(target=_copy, args=(proc.stderr, err, shown), daemon=True)]
        if stdin:
            threads.append(threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True))
        for t in threads:
            t.start()
        _copy(proc.stdout, out, shown)
        code = proc.wait()
        for t in threads:
            t.join(timeout=5)
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        return code


def _copy(src: IO[bytes], dst: TextIO, shown: Callable[[str], str] | None = None) -> None:
    if shown is not None:  # whole lines, each rewritten
        for line in iter(src.readline, b""):
            dst.write(shown(line.decode("utf-8", "replace")))
            dst.flush()
        return
    for chunk in iter(lambda: src.read1(65536), b""):  # type: ignore[attr-defined]
        dst.write(chunk.decode("utf-8", "replace"))
        dst.flush()


def _feed(dst: IO[bytes] | None, data: bytes) -> None:
    assert dst is not None
    try:
        dst.write(data)
        dst.close()
    except OSError:  # the remote side ended first; its exit status says why
        pass


def remote_path(path: str) -> str:
    """A path for the login shell: ``~/x`` as ``"$HOME"/x`` (quoted, the home expanded there)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)
