"""launcher.monitor.status_rows: pure readings of run directories and the row models of status/history/logs."""

from __future__ import annotations

import json

import pytest
from monitor_synth import T0, make_run

from launcher.monitor import history_rows, run_files, slurm_view, status_rows as monitor
from launcher.monitor.slurm_view import SlurmJob
from launcher.runs import registry as runs
from lmcore import jsonlines
from lmcore.slurm import client as slurm


def _row(home, name, job, *, reachable=True, now=T0):
    rec = runs.load_record(name, {"LMLAUNCH_HOME": str(home)})
    from pathlib import Path

    return monitor.build_row(rec, run_files.read_run_files(Path(rec.run_dir)), job, slurm_reachable=reachable, now=now)


def test_read_tail_reads_only_the_last_bytes_and_drops_cut_and_partial_lines(tmp_path):
    p = tmp_path / "hb.jsonl"
    lines = [json.dumps({"event": "step", "step": i, "pad": "x" * 100}) for i in range(1000)]
    p.write_text("\n".join(lines) + "\n" + '{"event": "step", "st')  # a write in progress
    tail = jsonlines.read_tail(p, max_bytes=4096)
    assert 20 < len(tail) < 40  # ~4 KB of ~130-byte lines, not the whole file
    assert tail[-1]["step"] == 999
    assert [t["step"] for t in tail] == list(range(1000 - len(tail), 1000))  # the cut first line is gone


def test_read_tail_of_missing_file_is_empty(tmp_path):
    assert jsonlines.read_tail(tmp_path / "nope.jsonl") == []


@pytest.mark.parametrize("text,secs", [("1-02:03:04", 93784), ("2:00:00", 7200), ("20:00", 1200), ("0:33", 33),
                                       ("30", 1800), ("2-3", 183600), ("2-03:04", 183840), ("UNLIMITED", None), ("", None),
                                       ("Partition_Limit", None)])
def test_slurm_durations_parse(text, secs):
    assert slurm.parse_duration(text) == secs


@pytest.mark.parametrize("nodelist,n", [("n[1-2]", 2), ("n1", 1), ("n[1-3,7],gpu5", 5), ("", 0), ("None assigned", 0)])
def test_hostlists_count_nodes(nodelist, n):
    assert slurm_view._count_nodes(nodelist) == n


def test_running_row_has_step_loss_rate_eta_and_checkpoint_age(tmp_path):
    make_run(tmp_path, "r", attempts=[{"job_id": "101", "start_step": 0, "end_step": 40, "t0": T0 - 100, "t1": T0}],
             checkpoint_step=30)
    job = SlurmJob("101", "RUNNING", "None", 1, "20:00", 2, "1:40", "n[1-2]")
    row = _row(tmp_path, "r", job)
    assert (row.state, row.group, row.reason, row.attempt, row.step, row.max_steps) == ("RUNNING", "running", None, 1, 40, 100)
    assert row.loss == pytest.approx(5.0 - 0.8) and row.tokens_per_s == 5040.0 and row.mfu == pytest.approx(0.31)
    assert row.checkpoint_step == 30 and row.checkpoint_age_s == pytest.approx(90)
    assert row.nodes == 2 and row.elapsed == "1:40" and row.time_limit == "20:00"
    # 10 steps per 24 s in this heartbeat -> 60 remaining steps take 144 s
    assert row.eta_s == pytest.approx(60 / (30 / 72), rel=1e-6)
    assert row.progress == pytest.approx(0.4)


def test_pending_row_shows_its_reason_and_attempt_one(tmp_path):
    make_run(tmp_path, "p", attempts=[])
    row = _row(tmp_path, "p", SlurmJob("101", "PENDING", "Resources", 1, "20:00", 2, "0:00", ""))
    assert (row.state, row.group, row.reason, row.attempt, row.step) == ("PENDING", "queued", "Resources", 1, None)
    assert row.eta_s is None


def test_requeued_job_pending_on_begin_time_counts_as_the_next_attempt(tmp_path):
    make_run(tmp_path, "q", attempts=[{"job_id": "101", "start_step": 0, "end_step": 30, "t0": T0 - 100, "t1": T0 - 10,
                                       "reason": "preempted", "requeued": True}], checkpoint_step=30)
    row = _row(tmp_path, "q", SlurmJob("101", "PENDING", "BeginTime", 2, "20:00", 2, "0:00", ""))
    assert (row.state, row.reason, row.attempt, row.requeued, row.step) == ("PENDING", "BeginTime", 2, True, 30)
    assert "requeued" in row.note


def test_a_finished_run_that_slurm_requeued_once_more_says_so(tmp_path):
    """SLURM 24.11 requeues a job that was preempted once more after its last run ended: the
    run has its DONE marker while the job pends on BeginTime."""
    make_run(tmp_path, "r", markers=("DONE",), attempts=[
        {"job_id": "101", "start_step": 0, "end_step": 50, "t0": T0 - 300, "t1": T0 - 200, "reason": "preempted",
         "requeued": True},
        {"job_id": "101", "start_step": 50, "end_step": 100, "t0": T0 - 100, "t1": T0 - 10, "reason": "completed"}])
    job = SlurmJob(job_id="101", state="PENDING", reason="BeginTime", attempts=3)
    row = _row(tmp_path, "r", job)
    assert (row.state, row.reason, row.attempt) == ("PENDING", "BeginTime", 3)
    assert row.note.startswith("finished (DONE marker), yet requeued by SLURM"), row.note


def test_second_attempt_running_before_its_ledger_line_is_still_attempt_two(tmp_path):
    make_run(tmp_path, "q2", attempts=[{"job_id": "101", "start_step": 0, "end_step": 30, "t0": T0 - 100, "t1": T0 - 10}])
    row = _row(tmp_path, "q2", SlurmJob("101", "RUNNING", "None", 2, "20:00", 2, "0:05", "n[1-2]"))
    assert row.attempt == 2


def test_attempts_count_across_the_job_ids_of_a_resumed_run(tmp_path):
    make_run(tmp_path, "m", job_ids=("101", "205"), attempts=[
        {"job_id": "101", "start_step": 0, "end_step": 30, "t0": T0 - 300, "t1": T0 - 200, "reason": "timeout"},
        {"job_id": "205", "start_step": 30, "end_step": 60, "t0": T0 - 100, "t1": T0 - 1},
    ])
    row = _row(tmp_path, "m", SlurmJob("205", "RUNNING", "None", 1, "20:00", 2, "1:39", "n[1-2]"))
    assert row.attempt == 2 and row.job_id == "205"


def test_unreachable_slurm_keeps_heartbeat_information(tmp_path):
    make_run(tmp_path, "u", attempts=[{"job_id": "101", "start_step": 0, "end_step": 50, "t0": T0 - 100, "t1": T0}])
    row = _row(tmp_path, "u", None, reachable=False)
    assert row.state == "unknown (SLURM unreachable)" and row.group == "unknown"
    assert row.step == 50 and row.attempt == 1 and row.loss is not None


def test_markers_decide_when_slurm_forgot_the_job(tmp_path):
    make_run(tmp_path, "d", markers=("DONE",))
    make_run(tmp_path, "c", markers=("CANCELLED",))
    make_run(tmp_path, "x")
    assert _row(tmp_path, "d", None).state == "COMPLETED"
    assert _row(tmp_path, "c", None).state == "CANCELLED"
    x = _row(tmp_path, "x", None)
    assert x.state == "UNKNOWN" and "neither squeue nor sacct" in x.note


@pytest.mark.parametrize("reason, detail, requeued, state", [
    ("limit_reached", "timeout: SIGUSR2 72 s before the time limit; max_timeouts(0) reached", False, "TIMEOUT"),
    ("limit_reached", "preempted: SIGTERM; max_preemptions(2) reached", False, "PREEMPTED"),
    ("timeout", "SIGUSR2 60 s before the time limit", False, "TIMEOUT"),
    ("crashed", "RuntimeError: boom", False, "FAILED"),
    ("hang", "rank 1 made no progress", False, "FAILED"),
    ("node_failure", "node n2 DOWN", False, "NODE_FAIL"),
    ("preempted", "SIGTERM", True, "UNKNOWN"),  # it asked for a requeue SLURM has no record of
])
def test_a_job_slurm_forgot_takes_its_state_from_the_last_end_line(tmp_path, reason, detail, requeued, state):
    """No sacct (or the job purged from it) and no marker: the last attempt's end line tells how
    the job ended, through the status cache too (which keeps that line)."""
    from launcher.monitor import status_cache

    make_run(tmp_path, "e", attempts=[{"job_id": "101", "start_step": 0, "end_step": 20, "t0": T0 - 100,
                                       "t1": T0 - 50, "reason": reason, "detail": detail, "requeued": requeued}])
    row = _row(tmp_path, "e", None)
    assert (row.state, row.group) == (state, slurm.state_group(state)), row
    assert f"attempt 1 ended {reason}" in row.note and "SLURM has no record of the job" in row.note, row.note
    rec = runs.load_record("e", {"LMLAUNCH_HOME": str(tmp_path)})
    env = {"LMLAUNCH_HOME": str(tmp_path)}
    for _ in range(2):  # the second reading comes from the cache
        (files,) = status_cache.read_all([rec.run_dir], env)
        cached = monitor.build_row(rec, files, None, slurm_reachable=True, now=T0)
        assert (cached.state, cached.note) == (row.state, row.note)
    # a later attempt that started (and wrote no end line) is not the ended one
    make_run(tmp_path, "f", job_ids=("101", "102"), attempts=[
        {"job_id": "101", "start_step": 0, "end_step": 20, "t0": T0 - 100, "t1": T0 - 50, "reason": reason,
         "detail": detail, "requeued": requeued},
        {"job_id": "102", "start_step": 20, "end_step": 30, "t0": T0 - 40, "t1": T0 - 5}])
    assert _row(tmp_path, "f", None).state == "UNKNOWN"


def test_a_crash_restarted_in_place_is_said_while_its_ranks_start_and_history_says_how_long_it_took(tmp_path):
    crashed = {"job_id": "101", "start_step": 0, "end_step": 47, "t0": T0 - 100, "t1": T0 - 10, "reason": "crashed",
               "requeued": True, "extra": {"restart": "in_place"}}
    make_run(tmp_path, "r", attempts=[crashed])
    row = _row(tmp_path, "r", SlurmJob("101", "RUNNING", "None", 1, "20:00", 2, "1:40", "n[1-2]"))
    assert row.note == ("restarting in place: attempt 1 ended crashed at step 47, its ranks start again in the same "
                        "allocation"), row.note
    make_run(tmp_path, "q", attempts=[{**crashed, "extra": {}}])  # requeued instead: no such note
    assert "in place" not in _row(tmp_path, "q", SlurmJob("101", "RUNNING", "None", 1, "20:00", 2, "1:40", "n[1-2]")).note
    ledger = [{"event": "start", "attempt": 1, "time": T0 - 100},
              {"event": "end", "attempt": 1, "time": T0 - 10, "reason": "crashed", "end_step": 47, "restart": "in_place"},
              {"event": "start", "attempt": 2, "time": T0 - 5},
              {"event": "startup", "attempt": 2, "process_start": T0 - 8.0, "phases": {"first_step": 7.5}}]
    assert history_rows.restart_notes(ledger) == [
        "attempt 2: restarted in place after attempt 1 crashed at step 47 (same job and nodes, no queue wait); its "
        "first step 9.5 s after attempt 1's end line"]
    assert history_rows.restart_notes(ledger[:3]) == [
        "attempt 2: restarted in place after attempt 1 crashed at step 47 (same job and nodes, no queue wait); no "
        "step of it recorded yet"]


def test_a_job_whose_tasks_never_started_says_where_to_look(tmp_path):
    make_run(tmp_path, "r", attempts=[])  # the tasks failed before lmtrain's entry: no attempt in the ledger
    row = _row(tmp_path, "r", SlurmJob("101", "FAILED", "NonZeroExitCode", 1, "20:00", 2, "0:03", "n[1-2]"))
    assert (row.state, row.group) == ("FAILED", "failed")
    assert row.note == ("job 101 ended before any attempt started: its tasks failed before the training entry "
                        "(`lmlaunch logs r --errors` shows why)"), row.note
    make_run(tmp_path, "s", attempts=[{"job_id": "101", "start_step": 0, "end_step": 5, "t0": T0 - 9, "t1": T0 - 1,
                                       "reason": "crashed"}])
    assert "before any attempt" not in _row(tmp_path, "s", SlurmJob("101", "FAILED", "NonZeroExitCode", 1, "20:00", 2,
                                                                     "0:03", "n[1-2]")).note


def test_history_goodput_steps_lost_and_queue_wait():
    ledger = [
        {"event": "start", "attempt": 1, "job_id": "7", "time": 1000.0, "start_step": 0, "nodes": ["n1"]},
        {"event": "end", "attempt": 1, "job_id": "7", "time": 1100.0, "end_step": 45, "reason": "preempted", "requeued": True},
        {"event": "start", "attempt": 2, "job_id": "7", "time": 1200.0, "start_step": 40, "nodes": ["n2"]},
        {"event": "end", "attempt": 2, "job_id": "7", "time": 1300.0, "end_step": 100, "reason": "completed"},
        {"event": "cancel_requested", "time": 1400.0},
    ]
    beats = [{"event": "step", "attempt": 1, "time": 1010.0 + i, "step": i} for i in range(0, 81, 10)]
    beats += [{"event": "step", "attempt": 2, "time": 1220.0 + i, "step": 40 + i} for i in range(0, 61, 10)]
    sacct = {"7": [(990.0, 995.0, 1105.0), (1150.0, 1195.0, 1305.0)]}
    h = history_rows.build_history("r", ledger, beats, sacct, now=2000.0)
    a1, a2 = h.attempts
    assert (a1.reason, a1.requeued, a1.steps_lost, a1.queue_wait_s, a1.alloc_s) == ("preempted", True, 5, 5.0, 110.0)
    assert (a2.reason, a2.steps_lost, a2.queue_wait_s, a2.alloc_s) == ("completed", None, 45.0, 110.0)
    assert a1.train_s == 80.0 and a2.train_s == 60.0
    assert h.goodput == pytest.approx(140 / 220)
    assert h.steps_lost_total == 5 and h.queue_wait_total_s == 50.0 and h.cancel_requested == 1400.0


def test_history_attempt_without_end_line_is_unknown_and_lost_steps_come_from_heartbeat():
    ledger = [
        {"event": "start", "attempt": 1, "job_id": "7", "time": 1000.0, "start_step": 0},
        {"event": "start", "attempt": 2, "job_id": "7", "time": 1200.0, "start_step": 20},
    ]
    beats = [{"event": "step", "attempt": 1, "time": 1000.0 + s, "step": s} for s in (10, 20, 30)]
    h = history_rows.build_history("r", ledger, beats, None, now=1_000_000.0)
    assert [a.reason for a in h.attempts] == ["unknown", "unknown"]
    assert h.attempts[0].steps_lost == 10 and h.attempts[0].end_time == 1030.0


def test_history_says_which_checkpoint_failed_its_checksums_and_what_the_attempt_resumed_from():
    ledger = [
        {"event": "start", "attempt": 1, "job_id": "7", "time": 1000.0, "start_step": 0},
        {"event": "end", "attempt": 1, "job_id": "7", "time": 1100.0, "end_step": 6, "reason": "preempted"},
        {"event": "checkpoint_rejected", "attempt": 2, "job_id": "8", "time": 1200.0, "step": 6,
         "detail": "rank-1.pt: xxh3_128 a differs from the b written", "fallback": "step-3"},
        {"event": "start", "attempt": 2, "job_id": "8", "time": 1201.0, "start_step": 3},
        {"event": "checkpoint_rejected", "attempt": 3, "job_id": "9", "time": 1300.0, "step": 3,
         "detail": "x: unreadable", "fallback": None},
    ]
    notes = history_rows.build_history("r", ledger, [], None, now=2000.0).notes
    assert notes == [
        "attempt 2: step-6 failed its checksums (rank-1.pt: xxh3_128 a differs from the b written); "
        "resumed from step-3 instead",
        "attempt 3: step-3 failed its checksums (x: unreadable); no older checkpoint was left",
    ]


def test_error_filter_keeps_whole_tracebacks_and_error_lines():
    lines = ["step 1 ok", "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
             "    boom()", "RuntimeError: boom", "step 2 ok", "srun: error: n2: task 1: Exited with exit code 1",
             "2026 [rank 0] ERROR lmtrain: failed", "all fine"]
    assert run_files.error_lines(lines) == lines[1:5] + lines[6:8]



def test_error_filter_keeps_a_container_runtimes_own_error_lines():
    """The lines a task step that failed before the entry leaves: podman's (runc's), apptainer's, pyxis'."""
    lines = ['Error: runc: runc create failed: unable to start container process: exec: "python3": executable file '
             "not found in $PATH: OCI runtime attempted to invoke a command that was not found",
             "FATAL:   could not open image /shared/x.sif: failed to retrieve path",
             "pyxis: failed to import docker image", "pyxis: importing docker image: nvcr.io/x",
             "srun: error: n1: task 0: Exited with exit code 127", "Errors seen: none", "no error: here"]
    assert run_files.error_lines(lines) == [lines[0], lines[1], lines[2], lines[4]]


def test_log_sources_fall_back_to_submitit_files_of_each_job(tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "submitit").mkdir(parents=True)
    for j in ("11", "12"):
        (run_dir / "submitit" / f"{j}_0_log.out").write_text(f"out {j}\n")
        (run_dir / "submitit" / f"{j}_0_log.err").write_text(f"err {j}\n")
    (run_dir / "submitit" / "12_1_log.out").write_text("rank 1\n")
    srcs = run_files.log_sources(run_dir, ["11", "12"])
    assert [s.path.name for s in srcs] == ["11_0_log.out", "11_0_log.err", "12_0_log.out", "12_0_log.err"]
    assert [s.path.name for s in run_files.log_sources(run_dir, ["11", "12"], rank=1)] == ["12_1_log.out"]
    (run_dir / "logs" / "attempt-2").mkdir(parents=True)
    (run_dir / "logs" / "attempt-10").mkdir(parents=True)
    (run_dir / "logs" / "attempt-2" / "rank-0.log").write_text("a2\n")
    (run_dir / "logs" / "attempt-10" / "rank-0.log").write_text("a10\n")
    assert [s.attempt for s in run_files.log_sources(run_dir, ["11", "12"])] == [2, 10]  # numeric order, per-attempt logs win


def test_log_sources_fall_back_to_a_tasks_lines_in_sruns_node_files_and_follow_them(tmp_path):
    """srun writes a job's tasks' output to a file per node (``%j_node-%n_log.out``), each line
    labelled with its task, padded to the step's widest (``srun --label``): a rank's fallback is its
    lines of its node's file, without the label; a label split across the reader's blocks is found."""
    run_dir = tmp_path / "r"
    import io

    from launcher.monitor.logs import print_logs
    from lmcore.run import rank_logs
    from lmcore.run.rundir import RunLayout

    sub = run_dir / "submitit"
    sub.mkdir(parents=True)
    (sub / "13_node-0_log.out").write_text(" 0: zero a\n 1: one\n 0: zero b\n")
    (sub / "13_node-1_log.out").write_text("x" * 70 + "\n 2: two\n11: eleven\n 2: \n")
    (sub / "13_node-1_log.err").write_text(" 2: Traceback (most recent call last):\n 2: ValueError: x\n")
    (sub / "13_node-x_log.out").write_text(" 2: not a node's file\n")
    (sub / "13_0_log.err").write_text("srun: error: n2: task 2: Exited with exit code 1\n")  # the batch script's
    srcs = run_files.log_sources(run_dir, ["13"], rank=2)
    assert [(s.path.name, s.rank, s.srun_labels) for s in srcs] == [("13_node-1_log.out", 2, True),
                                                                    ("13_node-1_log.err", 2, True),
                                                                    ("13_0_log.err", None, False)]
    out = io.StringIO()
    assert print_logs(run_dir, ["13"], out, rank=2) == 3
    assert out.getvalue() == ("──── job 13, task 2, srun out ────\ntwo\n\n──── job 13, task 2, srun err ────\n"
                              "Traceback (most recent call last):\nValueError: x\n"
                              "──── job 13, the batch script and srun, err ────\n"
                              "srun: error: n2: task 2: Exited with exit code 1\n"), out.getvalue()
    assert "eleven" not in out.getvalue() and "not a node" not in out.getvalue()
    assert [s.path.name for s in run_files.log_sources(run_dir, ["13"], rank=11)] == ["13_node-1_log.out",
                                                                                     "13_0_log.err"]
    assert rank_logs.srun_node_file_of(RunLayout.of(run_dir).submitit_node_logs("13", "out"), 2, chunk=8) == (
        sub / "13_node-1_log.out")  # its label across two blocks of 8 bytes
    assert rank_logs.srun_node_file_of(RunLayout.of(run_dir).submitit_node_logs("13", "out"), 1, chunk=5) == (
        sub / "13_node-0_log.out")
    assert rank_logs.srun_node_file_of(RunLayout.of(run_dir).submitit_node_logs("13", "out"), 3, chunk=8) is None


def test_a_ranks_log_is_its_lines_of_its_nodes_log_unmarked_followed_as_they_come(tmp_path):
    """The ranks' logs are one file per node (lmcore.run.rank_logs): `lmlaunch logs --rank R` shows R's
    lines, unmarked, from the node that holds them, and a line being written is shown once whole."""
    import io

    from launcher.monitor.logs import _LogPrinter
    from lmcore.run.rank_logs import NodeLogWriter

    run_dir = tmp_path / "r"
    logs = run_dir / "logs" / "attempt-1"
    w = {r: NodeLogWriter(logs / f"node-{r // 2}.log", r) for r in range(4)}
    w[2].write("rank 2 starts\n")
    w[3].write("rank 3 starts\nTraceback (most recent call last):\n")
    w[2].write("rank 2 ")  # half a line: held until its end
    srcs = run_files.log_sources(run_dir, [], rank=3)
    assert [(s.path.name, s.rank) for s in srcs] == [("node-1.log", 3)]
    assert run_files.log_sources(run_dir, [], rank=5) == []
    out = io.StringIO()
    printer = _LogPrinter(run_dir, [], out, rank=2, attempt=None, errors=False, follow=True)
    printer.poll(final=False)
    w[3].write("ValueError: bad batch\n")
    w[2].write("trains\n")
    printer.poll(final=False)
    shown = out.getvalue().splitlines()
    assert shown[1:] == ["rank 2 starts", "rank 2 trains"], shown
    w[1].write("\r" + "=" * 9000)  # a redrawn bar without a newline: written once it is long, not held for ever
    assert (logs / "node-0.log").read_bytes().endswith(b"[rank 1] \r" + b"=" * 9000 + b"\n")
    for writer in w.values():
        writer.close()
    # the run made again under its name (`--new`): rank 3 is on node 0 now, and the reader finds it there
    old_node_1 = (logs / "node-1.log").read_text()
    (logs / "node-1.log").unlink()
    again = NodeLogWriter(logs / "node-0.log", 3)
    again.write("rank 3 again\n")
    again.close()
    assert [s.path.name for s in run_files.log_sources(run_dir, [], rank=3)] == ["node-0.log"]
    assert old_node_1.splitlines() == [
        "[rank 2] rank 2 starts", "[rank 3] rank 3 starts", "[rank 3] Traceback (most recent call last):",
        "[rank 3] ValueError: bad batch", "[rank 2] rank 2 trains"]


def test_unreachable_slurm_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue on PATH
    view = slurm_view.query_slurm(["1", "2"], environ={"LMLAUNCH_HOME": str(tmp_path)})
    assert not view.reachable and "squeue" in view.message and view.jobs == {}


def test_status_finds_the_checkpoints_where_the_plan_put_them_and_means_the_newest_complete(tmp_path):
    """checkpoint.dir outside the run directory shows in status; a step whose COMPLETE is missing
    (a save killed half-way) is not "the newest checkpoint", whatever `latest` says."""
    import json

    from launcher.monitor.run_files import read_run_files

    run_dir, ckdir = tmp_path / "runs" / "r", tmp_path / "elsewhere" / "ckpts"
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"paths": {"checkpoint_dir": str(ckdir)}}))
    for step, complete in ((10, True), (20, True), (30, False)):
        d = ckdir / f"step-{step}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text("{}")
        if complete:
            (d / "COMPLETE").write_text(json.dumps({"step": step, "files": {"meta.json": 2}}))
    (ckdir / "latest").write_text("step-30\n")
    files = read_run_files(run_dir)
    assert files.checkpoint is not None and files.checkpoint.step == 20
    assert files.checkpoint.path == str(ckdir / "step-20")
    (run_dir / "plan.json").unlink()  # no plan: the default place, which holds nothing here
    assert read_run_files(run_dir).checkpoint is None


@pytest.mark.parametrize("reason, words", [
    ("Dependency", "waiting for train:ok (job 7)"),
    ("DependencyNeverSatisfied", "never starts: train:ok (job 7) did not succeed (`lmlaunch cancel eval`)"),
])
def test_a_run_waiting_on_another_says_on_which_and_whether_it_ever_can(tmp_path, reason, words):
    from launcher.monitor.run_files import RunFiles
    from launcher.monitor.slurm_view import SlurmJob

    rec = runs.RunRecord(name="eval", profile="local", run_dir=str(tmp_path), spec_path=None, job_ids=["8"],
                         after=["train:ok (job 7)"])
    row = monitor.build_row(rec, RunFiles(), SlurmJob("8", "PENDING", reason, 1), slurm_reachable=True, now=0.0)
    assert row.reason == reason and row.note == words


def test_history_reads_what_each_attempt_held_against_the_plan():
    """The ledger's memory lines (lmtrain.model.memory_held) against plan.json's memory: the worst rank's
    model states per attempt, an attempt on another world size said so, a device peak where kept."""
    ledger = [
        {"event": "start", "attempt": 1, "time": 100.0, "start_step": 0, "world_size": 2},
        {"event": "memory", "attempt": 1, "step": 2, "held": [{"params": 100, "grads": 60, "optimizer": 200, "buffers": 9},
                                                              {"params": 100, "grads": 40, "optimizer": 200, "buffers": 9}]},
        {"event": "memory", "attempt": 1, "step": 9, "device_peak": [5_000_000_000, 6_000_000_000]},
        {"event": "end", "attempt": 1, "time": 200.0, "end_step": 9, "reason": "preempted", "requeued": True},
        {"event": "start", "attempt": 2, "time": 300.0, "start_step": 9, "world_size": 4},
        {"event": "memory", "attempt": 2, "step": 11, "held": [{"params": 50, "grads": 20, "optimizer": 100}] * 4},
    ]
    h = history_rows.build_history("r", ledger, [], None, now=400.0)
    assert [(a.world_size, a.held_bytes, a.device_peak) for a in h.attempts] == [(2, 360, 6_000_000_000), (4, 170, None)]
    planned = {"rows": [{"name": "parameters", "bytes": 100}, {"name": "gradients", "bytes": 60},
                        {"name": "optimizer states", "bytes": 200}, {"name": "activations", "bytes": 7}], "peak": 6_500_000_000}
    notes = history_rows.memory_notes(h, planned, 2)
    assert notes[0] == ("memory, attempt 1: model states held 360 B per rank (planned 360 B); "
                        "device peak 6.00 GB (planned 6.50 GB)")
    assert "planned for 2 ranks, this attempt had 4" in notes[1] and "not kept on this device" in notes[1]


def test_history_names_a_job_that_ended_before_any_attempt_started():
    from launcher.monitor import history_rows

    ledger = [{"event": "start", "attempt": 1, "job_id": "7"}, {"event": "end", "attempt": 1, "job_id": "7"}]
    errors = {"7": ["srun: error: n1: task 0: Exited with exit code 1"],
              "9": ['Error: runc: runc create failed: exec: "python3": executable file not found in $PATH',
                    "srun: error: n1: task 0: Exited with exit code 127"],
              "11": []}
    notes = history_rows.unstarted_notes(["7", "9", "11"], ledger, errors)
    assert notes == ['job 9 ended before any attempt started (its tasks failed before the training entry): '
                     'Error: runc: runc create failed: exec: "python3": executable file not found in $PATH '
                     '(srun: error: n1: task 0: Exited with exit code 127)']


def test_history_reads_task_0s_errors_from_its_nodes_srun_file_then_the_batch_scripts(tmp_path):
    """Where `history` finds those lines: task 0's in the first node's srun file (labelled, the other
    tasks' lines left out), then srun's own in the batch script's stderr; a run of before had task 0's
    in the batch script's file, read as it is."""
    from launcher.commands.history import _task_errors
    from lmcore.run.rundir import RunLayout

    layout = RunLayout.of(tmp_path)
    layout.submitit.mkdir()
    (layout.submitit / "9_node-0_log.out").write_text(
        ' 0: Error: runc create failed: exec: "python3": executable file not found\n 1: Error: not task 0\n')
    (layout.submitit / "9_node-1_log.out").write_text(" 2: Error: not task 0 either\n")
    (layout.submitit / "9_0_log.err").write_text("srun: error: n1: task 0: Exited with exit code 127\nfine\n")
    (layout.submitit / "7_0_log.err").write_text("Traceback (most recent call last):\nValueError: old run\n")
    assert _task_errors(layout, ["9", "7", "5"]) == {
        "9": ['Error: runc create failed: exec: "python3": executable file not found',
              "srun: error: n1: task 0: Exited with exit code 127"],
        "7": ["Traceback (most recent call last):", "ValueError: old run"]}
