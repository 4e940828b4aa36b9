"""`preempt --start-now` starts a requeued job only when no node still holds its last run: a
step daemon of the job (``slurmstepd: [JOB.STEP]``) still alive on this machine counts, even
after its tasks are gone and ``scontrol listpids`` shows nothing (it would kill the new run)."""

from __future__ import annotations

import subprocess
import time

from launcher import rehearsal
from launcher.core import processes


def _titled_sleeper(title: str) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 30'])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and proc.pid not in processes.titled(title):
        time.sleep(0.02)
    return proc


def test_a_live_step_daemon_of_the_job_holds_every_wanted_node():
    daemon = _titled_sleeper("slurmstepd: [987654.0]")
    try:
        assert processes.titled("slurmstepd: [987654.") == [daemon.pid]
        assert processes.titled("slurmstepd: [98765.") == []  # another job's id is not a prefix match
        assert rehearsal.steps_left("987654", ["n1", "n2"]) == ["n1", "n2"]
    finally:
        daemon.kill()
        daemon.wait()
    assert processes.titled("slurmstepd: [987654.") == []  # reaped: gone; a zombie would not count either
