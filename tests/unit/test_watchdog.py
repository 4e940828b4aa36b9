"""The hang watchdog (lmtrain.health.watchdog) in real processes: it ends a stalled process with its
stacks on disk, also when the stalled thread holds the GIL, and leaves a beating one alone.
The cluster test (tests/integration/test_faults_hang.py) runs it inside a 2-rank SLURM job."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmcore.run.rundir import AttemptEnd, Ledger, RunLayout
from lmtrain.health import watchdog
from lmtrain.health.watchdog import EXIT_HANG, hang_markers, hang_reason

PRELUDE = """
import sys, time
from lmtrain.health.watchdog import ProgressWatchdog
reports = []
wd = ProgressWatchdog(timeout_s={timeout}, grace_s={grace}, stacks_file={stacks!r}, marker_file={marker!r},
                      rank=1, attempt=3, on_hang=lambda r: print("REPORT", r.step, flush=True))
wd.start()
print("STARTED", time.monotonic(), flush=True)
"""


def _run(tmp_path: Path, body: str, *, timeout: float = 1.0, grace: float = 2.0):
    """Run ``body`` after the watchdog started in a fresh interpreter; return the process, the
    seconds from the watchdog's start to the process's end (the interpreter's start, which a
    loaded host slows, is not counted: CLOCK_MONOTONIC is one clock for both processes), and the
    stacks and marker files."""
    stacks, marker = tmp_path / "stacks-rank-1.txt", tmp_path / "hang-rank-1.json"
    code = PRELUDE.format(timeout=timeout, grace=grace, stacks=str(stacks), marker=str(marker)) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    ended = time.monotonic()
    started = re.search(r"^STARTED (\S+)$", proc.stdout, re.M)
    assert started, proc.stdout + proc.stderr
    return proc, ended - float(started.group(1)), stacks, marker


def test_stalled_main_thread_is_dumped_and_exits_124_within_timeout_plus_linger(tmp_path):
    proc, elapsed, stacks, marker = _run(tmp_path, """
        for step in range(5):
            wd.beat(step); time.sleep(0.05)
        def stuck_in_a_collective():
            time.sleep(60)
        stuck_in_a_collective()
    """)
    assert proc.returncode == EXIT_HANG, proc.stderr
    assert elapsed < 1.0 + 1.0 + watchdog.LINGER_S + 5.0  # timeout + poll + linger + the scheduler's slack (busy machine)
    text = stacks.read_text()
    assert "made no progress" in text and "after step 4" in text
    assert "stuck_in_a_collective" in text  # the main thread's frame, from the watchdog thread
    assert "lmtrain-hang-watchdog" in text or "Thread" in text
    assert "REPORT 4" in proc.stdout
    rep = json.loads(marker.read_text())
    assert rep["rank"] == 1 and rep["attempt"] == 3 and rep["step"] == 4


def test_thread_holding_the_gil_is_ended_by_the_c_level_timer(tmp_path):
    # sre's matching loop never releases the GIL: the Python watchdog thread cannot run, the
    # C-level faulthandler timer must still dump the stacks and end the process.
    proc, elapsed, stacks, marker = _run(tmp_path, """
        import re
        wd.beat(7)
        def regex_holding_the_gil():
            re.match(r"(a+)+$", "a" * 64 + "b")
        regex_holding_the_gil()
    """, timeout=1.0, grace=2.0)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)  # faulthandler's _exit(1)
    assert elapsed < 1.0 + 2.0 + watchdog.REARM_EVERY_S + 5.0
    text = stacks.read_text()
    assert "regex_holding_the_gil" in text and "Timeout" in text
    assert not marker.exists()  # the Python thread never ran


def test_beating_process_is_left_alone_and_leaves_no_stacks_file(tmp_path):
    proc, _, stacks, marker = _run(tmp_path, """
        for step in range(30):
            wd.beat(step); time.sleep(0.1)
        wd.stop()
        time.sleep(3.0)  # past timeout + grace: the C timer is disarmed too
        print("survived", flush=True)
    """, timeout=1.0, grace=1.0)
    assert proc.returncode == 0, proc.stderr
    assert "survived" in proc.stdout
    assert not stacks.exists() and not marker.exists()


def test_hang_reason_names_peer_hangs_and_collective_timeouts_only(tmp_path):
    logs, layout = tmp_path / "logs", RunLayout.of(tmp_path)
    (logs / "attempt-2").mkdir(parents=True)
    assert hang_reason(ValueError("loss is nan"), layout, 2) is None
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 15000ms for recv")
    assert hang_reason(gloo, layout, 2) == "hang"
    # what gloo raised on the real cluster when watchdog.collective_timeout_s expired
    assert hang_reason(RuntimeError("Application timeout caused pair closure"), layout, 2) == "hang"
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:4040")
    assert hang_reason(closed, layout, 2) is None  # a peer that crashed is not a hang by itself
    (logs / "attempt-2" / "hang-rank-1.json").write_text(json.dumps({"rank": 1, "step": 5}))
    assert hang_markers(layout, 2) == [{"rank": 1, "step": 5}]
    assert hang_reason(closed, layout, 2) == "hang"  # ... unless that peer's watchdog says it hung
    assert hang_reason(None, layout, 1) is None  # other attempts are not this one


def test_ledger_end_line_is_written_once_per_attempt(tmp_path):
    ledger = Ledger(tmp_path / "attempts.jsonl")

    def end(attempt: int, reason: str) -> AttemptEnd:
        return AttemptEnd(attempt=attempt, job_id="7", time=1.0, end_step=3, reason=reason)

    assert ledger.write_end_once(end(1, "hang"))
    assert not ledger.write_end_once(end(1, "crashed"))  # the watchdog's thread and the entry both try
    assert ledger.write_end_once(end(2, "completed"))
    lines = [json.loads(x) for x in ledger.path.read_text().splitlines()]
    assert [(x["attempt"], x["reason"]) for x in lines] == [(1, "hang"), (2, "completed")]


@pytest.mark.parametrize("field,value", [("hang_timeout_s", 4), ("collective_timeout_s", 5), ("exit_grace_s", 0)])
def test_watchdog_spec_bounds_are_enforced(field, value):
    from pydantic import ValidationError

    from lmcore.job.spec import WatchdogSpec

    with pytest.raises(ValidationError, match=field):
        WatchdogSpec(**{field: value})
    assert WatchdogSpec(hang_timeout_s=None).hang_timeout_s is None
