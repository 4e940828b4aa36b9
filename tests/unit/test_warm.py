"""The warm answerer (launcher.remote.warm): a long-lived lmlaunch answers the read-only commands a
workstation forwards, on a Unix socket in the user's lmlaunch home, with exactly what the command
prints; the login shell's side falls back to lmlaunch itself whenever it cannot answer. The
over-ssh figure: `python bench/status_latency.py --over-ssh`."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys

import pytest
import waiting

from launcher.cli import main
from launcher.context import Context
from launcher.remote import warm


def _direct(argv: list[str], environ: dict[str, str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, Context(stdout=out, stderr=err, environ=dict(environ)))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def home(tmp_path):
    environ = {**os.environ, "LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"),
               "COLUMNS": "120"}
    environ.pop("LMLAUNCH_REMOTE", None)
    return environ


def _shell(environ: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    line = warm.remote_command(sys.executable, "echo FALLBACK; exit 7", args, ["LMLAUNCH_FORWARDED=1"])
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=environ, timeout=waiting.HANG_S)


def test_a_warm_process_answers_what_the_command_prints_and_falls_back_otherwise(home):
    want = _direct(["history", "nothing-here"], home)
    assert want[0] != 0 and "nothing-here" in want[2]  # an unknown run: an error, exit code and all
    assert _shell(home, ["status"]).stdout == "FALLBACK\n"  # no warm process: lmlaunch as before
    with warm.Answering(home, main) as server:
        sock = warm.socket_path(home)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700 and sock.is_socket()
        got = _shell(home, ["history", "nothing-here"])
        assert (got.returncode, got.stdout, got.stderr) == want
        status = _shell(home, ["status"])
        assert (status.returncode, status.stdout) == _direct(["status"], home)[:2]
        # what it does not answer goes to lmlaunch itself: a stream, a command that acts
        assert _shell(home, ["logs", "r", "--follow"]).stdout == "FALLBACK\n"
        assert _shell(home, ["cancel", "r"]).stdout == "FALLBACK\n"
        # another cluster's settings: not this process's runs
        assert _shell({**home, "SLURM_CONF": "/elsewhere/slurm.conf"}, ["status"]).stdout == "FALLBACK\n"
        assert server.reply(_Conn(b""), uid=os.getuid() + 1) == {"refused": "another user"}
    assert not warm.socket_path(home).exists()  # gone with the process
    assert _shell(home, ["status"]).stdout == "FALLBACK\n"


def test_a_stale_socket_is_replaced_and_a_second_process_leaves_the_first_one_answering(home):
    sock = warm.socket_path(home)
    sock.parent.mkdir(parents=True)
    import socket as sockets

    stale = sockets.socket(sockets.AF_UNIX)
    stale.bind(str(sock))
    stale.close()  # a crashed process's socket file, nobody listening
    with warm.Answering(home, main), warm.Answering(home, main):
        assert _shell(home, ["status"]).stdout != "FALLBACK\n"


class _Conn:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def recv(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk
