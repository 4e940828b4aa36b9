"""Process helpers for the local cluster: pid files, liveness, ports, waiting."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from lmcore.errors import UserError
from lmcore.processes import alive


class ClusterError(UserError):
    """The local cluster could not be started (exit code 1); the message names the log to read."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


def read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# A daemon writes its pid file after it started; a live process that started later than that is
# another one that got the pid after the daemon died (seen: a worker cluster's stale slurmd pid,
# reused by a process of the next start-up, made `up` skip starting that slurmd). Slack for
# /proc/stat's boot time, which is whole seconds.
PID_REUSE_SLACK_S = 2.0


def running_from_pidfile(pidfile: Path) -> int | None:
    """The pid in ``pidfile`` if that process is alive and is the one that wrote it: it started
    before the file was written, or (the machine's clock stepped forward since, which moves every
    process's start as /proc tells it: seen, 42 s on a VM) it is the file's daemon of this cluster by
    its command line (:func:`names_daemon`)."""
    pid = read_pid(pidfile)
    if pid is None or not alive(pid):
        return None
    started = started_at(pid)
    try:
        written = pidfile.stat().st_mtime
    except OSError:
        return None
    if started is not None and started > written + PID_REUSE_SLACK_S and not names_daemon(pid, pidfile):
        return None
    return pid


def names_daemon(pid: int, pidfile: Path) -> bool:
    """Whether process ``pid`` is the daemon ``pidfile`` is named for (``slurmctld.pid``,
    ``slurmd-n2.pid``: slurmd -N n2, ``mariadbd.pid``) of the cluster whose state directory holds
    the file: its program has the daemon's name and its arguments or environment name that
    directory (``-f STATE/etc/slurm.conf``, ``SLURM_CONF=...``, ``--datadir=STATE/mysql/data``)."""
    daemon, _, node = pidfile.stem.partition("-")
    state = str(pidfile.parent.parent).rstrip("/") + "/"  # w1/ is not w10/
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return False
    if not argv or Path(argv[0]).name != daemon:
        return False
    if node and not any(a == "-N" and b == node for a, b in zip(argv, argv[1:])):
        return False
    return any(state in arg for arg in argv[1:]) or state in environ


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), from /proc; None when unknown."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# A daemon still writing its log is still starting: on a slow or loaded machine it gets this many
# times its ``timeout`` in all, as long as its log grows within every ``timeout`` seconds.
SLOW_START_FACTOR = 10


def wait_until(check: Callable[[], bool], timeout: float, what: str, log: Path | None, poll: float = 0.3) -> None:
    """Until ``check()``: fails when ``timeout`` seconds pass without ``log`` growing (a daemon that
    stalled), or after ``SLOW_START_FACTOR`` x ``timeout`` in all, with the log's last lines."""
    start = last_growth = time.monotonic()
    size = _size(log)
    while not check():
        now = time.monotonic()
        if (grown := _size(log)) != size:
            size, last_growth = grown, now
        if now - last_growth > timeout or now - start > SLOW_START_FACTOR * timeout:
            tail = ""
            if log is not None and log.exists():
                lines = log.read_text(errors="replace").splitlines()[-8:]
                tail = "\n  " + "\n  ".join(lines)
            where = f" (log: {log})" if log is not None else ""
            raise ClusterError(f"{what} did not come up: {now - start:.0f} s, its log quiet for "
                               f"{now - last_growth:.0f} s{where}{tail}")
        time.sleep(poll)


def _size(log: Path | None) -> int:
    try:
        return log.stat().st_size if log is not None else -1
    except OSError:
        return -1


def spawn(args: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start a daemon detached from this process (own session, no inherited stdio)."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        if log is not None and not isinstance(out, int):
            out.close()


def run_checked(args: Sequence[str], what: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what}: `{' '.join(args)}` did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed: `{' '.join(args)}`: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def stop(pidfile: Path, name: str, timeout: float = 20.0, *, find: Callable[[], int | None] | None = None) -> str | None:
    """SIGTERM the daemon named by ``pidfile`` (then SIGKILL); returns a line for the user. ``find``: how
    to tell its pid when the pid file's age cannot (default :func:`running_from_pidfile`)."""
    pid = find() if find is not None else running_from_pidfile(pidfile)
    if pid is None:
        if pidfile.exists():
            pidfile.unlink(missing_ok=True)
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        how = "killed"
    else:
        how = "stopped"
    pidfile.unlink(missing_ok=True)
    return f"{how} {name} (pid {pid})"


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block (released when the process dies, too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
