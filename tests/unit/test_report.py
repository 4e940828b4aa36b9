"""lmlaunch report: a valid PNG of the expected pixel size with each stop marked, and a summary."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

from monitor_synth import T0, make_run

from launcher.cli import main
from launcher.context import Context
from launcher.monitor import history_rows
from launcher.monitor.report import DPI, FIGSIZE_IN, build_report
from lmcore import jsonlines

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    assert data.endswith(b"IEND\xaeB`\x82")  # the closing chunk: the file is whole
    return struct.unpack(">II", data[16:24])


def _run(home: Path) -> Path:
    return make_run(home, "rep", attempts=[
        {"job_id": "7", "start_step": 0, "end_step": 50, "t0": T0 - 1000, "t1": T0 - 800, "reason": "preempted",
         "requeued": True},
        {"job_id": "7", "start_step": 40, "end_step": 100, "t0": T0 - 600, "t1": T0 - 400, "reason": "completed"},
    ])


def test_report_marks_each_stop_and_summarizes(tmp_path):
    run_dir = _run(tmp_path)
    beats = jsonlines.read_jsonl(run_dir / "metrics" / "heartbeat.jsonl")
    h = history_rows.build_history("rep", jsonlines.read_jsonl(run_dir / "attempts.jsonl"), beats, None, now=T0)
    r = build_report("rep", beats, h)
    assert [(s.attempt, s.step, s.reason) for s in r.stops] == [(1, 50, "preempted")]
    assert r.summary[0] == "run rep: 2 attempt(s), 1 stop(s) (preempted)"
    assert r.summary[1].startswith("steps 10 -> 100 in ")
    assert "steps lost to stops 10" in r.summary[-1]


def test_report_command_writes_a_png_of_the_expected_size(tmp_path, monkeypatch):
    _run(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no SLURM: queue wait unknown, report still drawn
    out_png = tmp_path / "out" / "report.png"
    out = io.StringIO()
    code = main(["report", "rep", "-o", str(out_png), "--json"], Context(out, io.StringIO(), {"LMLAUNCH_HOME": str(tmp_path)}))
    assert code == 0
    data = json.loads(out.getvalue())
    assert data["png"] == str(out_png) and data["stops"][0]["reason"] == "preempted" and data["points"] == 11
    assert _png_size(out_png) == (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
    monkeypatch.setenv("COLUMNS", "1000")  # rich's width: the path on one line
    terminal = _Terminal()  # on a terminal it says what it draws (then erases it); not under --json above
    code = main(["report", "rep", "-o", str(out_png)], Context(io.StringIO(), terminal, {"LMLAUNCH_HOME": str(tmp_path)}))
    assert code == 0 and f"drawing {out_png}" in terminal.getvalue(), terminal.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_report_of_a_run_without_steps_fails_with_a_clear_message(tmp_path):
    make_run(tmp_path, "empty")
    err = io.StringIO()
    code = main(["report", "empty"], Context(io.StringIO(), err, {"LMLAUNCH_HOME": str(tmp_path)}))
    assert code == 1 and "has no training steps" in err.getvalue()


def test_report_refuses_a_non_png_output(tmp_path):
    _run(tmp_path)
    err = io.StringIO()
    code = main(["report", "rep", "-o", str(tmp_path / "r.jpg")], Context(io.StringIO(), err, {"LMLAUNCH_HOME": str(tmp_path)}))
    assert code == 2 and "ending in .png" in err.getvalue()
