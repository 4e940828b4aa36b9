"""Rendering at a fixed terminal width, captured to text: status, history and logs, from
synthetic run directories (no SLURM)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from monitor_synth import T0, make_run
from rich.console import Console

from launcher.cli import main
from launcher.context import Context
from launcher.monitor import history_rows, run_files, status_rows as monitor
from launcher.monitor.logs import print_logs
from launcher.monitor.slurm_view import SlurmJob, SlurmView
from launcher.monitor.view import history_view, status_view
from launcher.runs import registry as runs
from lmcore import jsonlines

WIDTH = 150


def _render(renderable, width: int = WIDTH) -> str:
    con = Console(file=io.StringIO(), width=width, record=True, color_system=None, highlight=False)
    con.print(renderable)
    return con.export_text()


def _status_rows(home: Path):
    make_run(home, "train-a", job_ids=("101",), attempts=[
        {"job_id": "101", "start_step": 0, "end_step": 40, "t0": T0 - 100, "t1": T0}], checkpoint_step=30)
    make_run(home, "queued-b", job_ids=("102",))
    make_run(home, "requeued-c", job_ids=("103",), attempts=[
        {"job_id": "103", "start_step": 0, "end_step": 60, "t0": T0 - 500, "t1": T0 - 50, "reason": "preempted",
         "requeued": True}], checkpoint_step=60)
    make_run(home, "done-d", job_ids=("104",), attempts=[
        {"job_id": "104", "start_step": 0, "end_step": 100, "t0": T0 - 900, "t1": T0 - 600, "reason": "completed"}],
        markers=("DONE",))
    jobs = {
        "101": SlurmJob("101", "RUNNING", "None", 1, "20:00", 2, "1:40", "n[1-2]"),
        "102": SlurmJob("102", "PENDING", "Priority", 1, "20:00", 2, "0:00", ""),
        "103": SlurmJob("103", "PENDING", "BeginTime", 2, "20:00", 2, "0:00", ""),
        "104": SlurmJob("104", "COMPLETED", "", 1, "", 2, "5:00", "n[1-2]", "sacct"),
    }
    env = {"LMLAUNCH_HOME": str(home)}
    rows = []
    for rec in runs.list_records(env):
        files = run_files.read_run_files(Path(rec.run_dir), with_plan_time=True)
        rows.append(monitor.build_row(rec, files, jobs[rec.last_job_id], slurm_reachable=True, now=T0))
    return rows, jobs


def test_status_table_at_150_columns_shows_every_column_for_each_state(tmp_path):
    rows, jobs = _status_rows(tmp_path)
    text = _render(status_view(rows, SlurmView(jobs)))
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines)
    header = lines[0].split()
    assert header == ["RUN", "JOB", "STATE", "NODES", "TIME/LIMIT", "ATT", "PROGRESS", "LOSS", "TOK/S", "MFU", "CKPT", "ETA"]
    by_name = {line.split()[0]: line for line in lines[1:5]}
    assert set(by_name) == {"train-a", "queued-b", "requeued-c", "done-d"}
    a = by_name["train-a"]
    assert "RUNNING" in a and "1:40/20:00" in a and "40/100" in a and "4.200" in a and "5040" in a
    assert "31.0%" in a and "30 (1m30s ago)" in a and "2m24s" in a  # MFU, checkpoint age, ETA
    assert "━━━━━╺" in a  # 40% of a 12-wide bar
    assert "PENDING (Priority)" in by_name["queued-b"]
    c = by_name["requeued-c"]
    assert "PENDING (BeginTime)" in c and " 2↻ " in c and "60/100" in c
    d = by_name["done-d"]
    assert "COMPLETED" in d and "100/100" in d and "5:00/-" in d
    assert "  · requeued-c: requeued, waiting to restart" in lines


def test_status_when_slurm_is_unreachable_says_so_above_the_table(tmp_path):
    make_run(tmp_path, "r", attempts=[{"job_id": "9", "start_step": 0, "end_step": 20, "t0": T0 - 60, "t1": T0}])
    rec = runs.load_record("r", {"LMLAUNCH_HOME": str(tmp_path)})
    row = monitor.build_row(rec, run_files.read_run_files(Path(rec.run_dir)), None, slurm_reachable=False, now=T0)
    text = _render(status_view([row], SlurmView({}, reachable=False, message="SLURM command 'squeue' not found")))
    assert text.startswith("SLURM unreachable: SLURM command 'squeue' not found")
    assert "unknown (SLURM unreachable)" in text and "20/100" in text


def test_status_command_without_slurm_prints_json_and_a_table(tmp_path, monkeypatch):
    make_run(tmp_path, "r", attempts=[{"job_id": "9", "start_step": 0, "end_step": 20, "t0": T0 - 60, "t1": T0}])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    env = {"LMLAUNCH_HOME": str(tmp_path), "COLUMNS": "120"}
    out = io.StringIO()
    assert main(["status", "--json"], Context(out, io.StringIO(), env)) == 0
    import json

    data = json.loads(out.getvalue())
    assert data["slurm"]["reachable"] is False and "squeue" in data["slurm"]["message"]
    assert data["runs"][0]["state"] == "unknown (SLURM unreachable)" and data["runs"][0]["step"] == 20
    out = io.StringIO()
    assert main(["status", "r"], Context(out, io.StringIO(), env)) == 0
    text = out.getvalue()
    assert text.startswith("SLURM unreachable: SLURM command 'squeue' not found")
    assert "\x1b[" not in text  # no colors into a pipe
    table = text.splitlines()[2:]
    assert table[0].split()[:3] == ["RUN", "JOB", "STATE"] and "unknown (SLURM unreachable)" in table[1]


def test_history_table_at_120_columns(tmp_path):
    make_run(tmp_path, "h", attempts=[
        {"job_id": "7", "start_step": 0, "end_step": 50, "t0": T0 - 1000, "t1": T0 - 800, "reason": "preempted",
         "requeued": True, "detail": "SIGTERM; checkpoint step-50 complete"},
        {"job_id": "7", "start_step": 40, "end_step": 100, "t0": T0 - 600, "t1": T0 - 400, "reason": "completed"},
    ])
    run_dir = tmp_path / "runs" / "h"
    h = history_rows.build_history("h", jsonlines.read_jsonl(run_dir / "attempts.jsonl"),
                              jsonlines.read_jsonl(run_dir / "metrics" / "heartbeat.jsonl"),
                              {"7": [(T0 - 1010, T0 - 1000, T0 - 800), (T0 - 700, T0 - 600, T0 - 400)]}, now=T0)
    text = _render(history_view(h), width=120)
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines)
    assert lines[0].startswith("h: 2 attempt(s) · goodput ") and "steps lost to stops 10 · queue wait 1m50s" in lines[0]
    assert lines[1].split() == ["ATT", "JOB", "NODES", "STARTED", "QUEUED", "STEPS", "ENDED", "LOST", "TRAIN/ALLOC", "GOODPUT"]
    row1, row2 = lines[2].split(), lines[3].split()
    assert row1[0] == "1" and "10s" in row1 and "0" in row1 and "50" in row1 and "preempted" in row1 and "↻" in row1
    assert row2[0] == "2" and "1m40s" in row2 and "completed" in row2
    assert "  attempt 1: SIGTERM; checkpoint step-50 complete" in lines


def test_history_at_80_columns_keeps_why_each_attempt_ended_whole(tmp_path):
    """A pipe is 80 columns wide: the other columns shrink, the reasons do not (seen: 'limi…')."""
    make_run(tmp_path, "a-rather-long-run-name-of-a-sweep-point.12", job_ids=("1037_12",), attempts=[
        {"job_id": "1037_12", "start_step": 0, "end_step": 22, "t0": T0 - 1000, "t1": T0 - 800,
         "reason": "limit_reached", "nodes": ["node-with-a-long-name-17"], "requeued": True},
        {"job_id": "1037_12", "start_step": 22, "end_step": 22, "t0": T0 - 600, "t1": T0 - 590,
         "reason": "preflight_failed", "nodes": ["node-with-a-long-name-18"]},
    ])
    run_dir = tmp_path / "runs" / "a-rather-long-run-name-of-a-sweep-point.12"
    h = history_rows.build_history(run_dir.name, jsonlines.read_jsonl(run_dir / "attempts.jsonl"),
                                   jsonlines.read_jsonl(run_dir / "metrics" / "heartbeat.jsonl"), None, now=T0)
    lines = _render(history_view(h), width=80).splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    first = next(line for line in lines if line.lstrip().startswith("1 "))
    second = next(line for line in lines if line.lstrip().startswith("2 "))
    assert "1037_12" in first and "limit_reached ↻" in first, lines
    assert "1037_12" in second and "preflight_failed" in second, lines


def test_logs_print_attempts_in_order_with_markers_and_filter_errors(tmp_path):
    make_run(tmp_path, "l", attempts=[
        {"job_id": "7", "start_step": 0, "end_step": 50, "t0": T0 - 1000, "t1": T0 - 800, "reason": "preempted"},
        {"job_id": "7", "start_step": 50, "end_step": 100, "t0": T0 - 600, "t1": T0 - 400, "reason": "completed"},
    ], log_lines={1: ["a1 line", "Traceback (most recent call last):", "  File 'x'", "KeyError: 'k'"],
                  2: ["a2 line", "done"]})
    run_dir = tmp_path / "runs" / "l"
    out = io.StringIO()
    assert print_logs(run_dir, ["7"], out) == 2
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("──── attempt 1 · job 7 · on n1,n2 · from step 0 · started ")
    assert lines[0].endswith(" · ended preempted at step 50 ────")
    assert lines[1:5] == ["a1 line", "Traceback (most recent call last):", "  File 'x'", "KeyError: 'k'"]
    assert lines[5].startswith("──── attempt 2 · job 7") and lines[6:] == ["a2 line", "done"]
    out = io.StringIO()
    print_logs(run_dir, ["7"], out, errors=True)
    assert [x for x in out.getvalue().splitlines() if not x.startswith("────")] == lines[2:5]
    out = io.StringIO()
    print_logs(run_dir, ["7"], out, attempt=2)
    assert out.getvalue().splitlines()[1:] == ["a2 line", "done"]


def test_logs_follow_picks_up_new_output_and_a_new_attempt_then_stops_when_done(tmp_path):
    make_run(tmp_path, "f", log_lines={1: ["first"]})
    run_dir = tmp_path / "runs" / "f"
    out = io.StringIO()

    def writer():
        time.sleep(0.15)
        with open(run_dir / "logs" / "attempt-1" / "rank-0.log", "a") as f:
            f.write("second\npart")
            f.flush()
            time.sleep(0.1)
            f.write("ial\n")
        time.sleep(0.1)
        (run_dir / "logs" / "attempt-2").mkdir()
        (run_dir / "logs" / "attempt-2" / "rank-0.log").write_text("third\n")
        (run_dir / "DONE").write_text("")

    t = threading.Thread(target=writer)
    t.start()
    n = print_logs(run_dir, [], out, follow=True, interval=0.05,
                   finished=lambda: (run_dir / "DONE").exists())
    t.join()
    lines = out.getvalue().splitlines()
    assert n == 2
    assert [x for x in lines if not x.startswith("────")] == ["first", "second", "partial", "third"]
    assert lines[0].startswith("──── attempt 1") and lines[4].startswith("──── attempt 2")
