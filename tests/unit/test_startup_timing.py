"""Where an attempt spends its startup: the clock of the task process (lmtrain.observe.startup), the
ledger's ``startup`` record, and how `lmlaunch history --timing` shows it."""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys
import time

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.cli import main
from launcher.context import Context
from launcher.monitor import history_rows
from lmcore.run import rundir
from lmcore.run.checkpoint_index import CompleteCheckpoint
from lmcore.run.rundir import STARTUP_PHASES, AttemptStartup, Ledger
from lmtrain.observe.startup import StartupClock, process_start_time


def test_imports_run_with_the_collector_paused_and_what_they_made_is_frozen():
    """In a fresh interpreter (this one's collector state is pytest's): paused inside, running
    again after, the imported modules' objects frozen only when asked, the collector's state
    restored when an import fails, and left off when it was off."""
    code = """
import gc, sys
from lmtrain.observe.startup import imports_without_gc
before = gc.get_freeze_count()
with imports_without_gc(freeze=False):
    assert not gc.isenabled()
    import email.parser
assert gc.isenabled() and gc.get_freeze_count() == before  # a process that holds more than the imports
with imports_without_gc(freeze=True):
    assert not gc.isenabled()
    import json.decoder, http.client
assert gc.isenabled() and gc.get_freeze_count() > before
try:
    with imports_without_gc(freeze=True):
        import no_such_module_here
except ImportError:
    assert gc.isenabled()
else:
    raise AssertionError("the failed import was swallowed")
gc.disable()
with imports_without_gc(freeze=True):
    pass
assert not gc.isenabled()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert gc.isenabled()  # pytest's collection pause (tests/conftest.py) ended with the collection


def test_the_start_time_of_a_process_is_when_it_was_started_to_10_ms():
    before = time.time()
    child = subprocess.Popen(["sleep", "5"])
    try:
        time.sleep(0.6)  # the child's age, not the time of asking, decides
        started = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    assert started is not None and before - 0.02 <= started <= before + 0.3, (before, started)
    assert process_start_time(10**9) is None  # no such process


def test_the_clock_keeps_the_first_mark_of_each_phase_and_refuses_unknown_phases():
    clock = StartupClock(process_start=1000.0)
    clock.mark("entry", at=1000.25)
    clock.mark("imports", at=1004.0)
    clock.mark("imports", at=1009.0)  # a second mark of a phase changes nothing
    clock.mark("first_step", at=1006.5)
    with pytest.raises(ValueError, match="unknown startup phase 'import'; phases: entry, imports"):
        clock.mark("import")
    rec = clock.record(attempt=2, job_id="17", checkpoint_bytes=123)
    assert rec == AttemptStartup(attempt=2, job_id="17", process_start=1000.0,
                                 phases={"entry": 0.25, "imports": 4.0, "first_step": 6.5}, checkpoint_bytes=123)
    assert rec.to_json() == {"event": "startup", "attempt": 2, "job_id": "17", "process_start": 1000.0,
                             "phases": {"entry": 0.25, "imports": 4.0, "first_step": 6.5}, "checkpoint_bytes": 123}


def test_a_second_attempt_in_the_same_process_starts_its_own_clock():
    clock = StartupClock(process_start=1000.0)
    clock.begin_attempt()  # the first attempt keeps the process's start
    assert clock.process_start == 1000.0
    clock.mark("entry", at=1000.5)
    clock.begin_attempt()  # e.g. a bench calling the entry again
    assert clock.process_start > 1000.0 and clock.ends == {}
    clock.mark("entry")
    assert 0 <= clock.record(2, None, None).phases["entry"] < 5


def test_a_checkpoints_size_comes_from_its_manifest(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 5)
    ckpt = CompleteCheckpoint(step=5, path=tmp_path)
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 5, "files": {"a": 10, "sub/b": 5}}))
    assert ckpt.size_bytes() == 15
    (tmp_path / "COMPLETE").write_text("5\n")  # an older COMPLETE without a manifest: the files count
    assert ckpt.size_bytes() == 15 + 2


def _startup(attempt: int, start: float, ends: dict[str, float], ckpt: int | None = None) -> dict:
    return AttemptStartup(attempt=attempt, job_id="17", process_start=start, phases=ends,
                          checkpoint_bytes=ckpt).to_json()


FULL = dict(zip(STARTUP_PHASES, (0.2, 4.0, 4.2, 4.25, 4.3, 4.4, 5.0, 5.1)))


def test_the_breakdown_is_seconds_per_phase_with_the_launch_from_the_allocation():
    got = rundir.startup_breakdown(_startup(2, 1003.5, FULL), alloc_start=1002.0)
    assert list(got) == ["launch", *STARTUP_PHASES]
    assert got == pytest.approx({"launch": 1.5, "entry": 0.2, "imports": 3.8, "gate": 0.2, "rendezvous": 0.05,
                                 "data": 0.05, "model": 0.1, "restore": 0.6, "first_step": 0.1})
    # an attempt that never reached its first step: the phases it reached, no launch without sacct
    partial = rundir.startup_breakdown(_startup(1, 1000.0, {"entry": 0.3, "imports": 4.0, "gate": 4.5}))
    assert partial == pytest.approx({"entry": 0.3, "imports": 3.7, "gate": 0.5})


def test_history_rows_carry_the_startup_of_each_attempt():
    ledger = [
        {"event": "start", "attempt": 1, "job_id": "17", "time": 1005.0, "start_step": 0, "nodes": ["n1"]},
        _startup(1, 1000.0, FULL),
        {"event": "end", "attempt": 1, "job_id": "17", "time": 1100.0, "end_step": 40, "reason": "preempted",
         "requeued": True},
        {"event": "start", "attempt": 2, "job_id": "17", "time": 1115.0, "start_step": 40, "nodes": ["n1"]},
        _startup(2, 1110.0, {k: v for k, v in FULL.items() if k != "first_step"}, ckpt=5_000_000),
        {"event": "end", "attempt": 2, "job_id": "17", "time": 1117.0, "end_step": 40, "reason": "cancelled"},
    ]
    sacct = {"17": [(990.0, 999.0, 1100.0), (1101.0, 1109.0, 1117.0)]}
    h = history_rows.build_history("r", ledger, [], sacct, now=2000.0)
    first, second = h.attempts
    assert first.startup["launch"] == pytest.approx(1.0) and first.startup_total_s == pytest.approx(6.1)
    assert first.checkpoint_bytes is None
    assert second.startup["launch"] == pytest.approx(1.0) and "first_step" not in second.startup
    assert second.startup_total_s is None and second.checkpoint_bytes == 5_000_000
    assert h.to_dict()["attempts"][1]["startup"]["restore"] == pytest.approx(0.6)


def _local_run_dir(tmp_path, ledger: list[dict]):
    run_dir = tmp_path / "runs" / "loc"
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"run_name": "loc", "profile": "local"}))
    for e in ledger:
        Ledger(run_dir / "attempts.jsonl").write(_Raw(e))
    return run_dir


class _Raw:
    def __init__(self, d: dict) -> None:
        self.d = d

    def to_json(self) -> dict:
        return self.d


def _cli(tmp_path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    ctx = Context(stdout=out, stderr=out, environ={"LMLAUNCH_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    return main(list(args), ctx), out.getvalue()


def test_history_timing_of_a_local_run_given_by_its_directory(tmp_path):
    run_dir = _local_run_dir(tmp_path, [
        {"event": "start", "attempt": 1, "job_id": "local-1", "time": 1005.0, "start_step": 0, "nodes": ["vm"]},
        _startup(1, 1000.0, FULL, ckpt=3_000_000),
        {"event": "end", "attempt": 1, "job_id": "local-1", "time": 1010.0, "end_step": 8, "reason": "completed"},
    ])
    code, out = _cli(tmp_path, "history", str(run_dir), "--timing")
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("ATT"))
    assert header.split() == ["ATT", "LAUNCH", "ENTRY", "IMPORTS", "GATE", "RDZV", "DATA", "MODEL", "RESTORE",
                              "1ST", "STEP", "TOTAL", "CHECKPOINT"]
    row = next(line for line in out.splitlines() if line.lstrip().startswith("1 "))
    assert row.split() == ["1", "-", "0.20", "3.80", "0.20", "0.05", "0.05", "0.10", "0.60", "0.10", "5.10", "3.0", "MB"]
    code, out = _cli(tmp_path, "history", str(run_dir), "--json")
    assert code == 0 and json.loads(out)["attempts"][0]["startup_total_s"] == pytest.approx(5.1)


def test_a_directory_without_a_plan_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    code, out = _cli(tmp_path, "history", str(tmp_path / "empty"), "--timing")
    assert code == 2 and "nor a run directory with a plan.json" in out, out


def test_an_attempt_before_startup_records_says_so(tmp_path):
    run_dir = _local_run_dir(tmp_path, [
        {"event": "start", "attempt": 1, "job_id": "local-1", "time": 1005.0, "start_step": 0, "nodes": ["vm"]},
    ])
    code, out = _cli(tmp_path, "history", str(run_dir), "--timing")
    assert code == 0 and "no attempt has a startup record" in out, out
