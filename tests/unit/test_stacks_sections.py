"""`lmlaunch stacks`, the parts that need no cluster: the task records the runtime writes, the
srun step's command line, the node script (run here in a real bash against a real Python
process with the real py-spy), the reading of the step's labelled output into one section per
rank, and the errors. The step on the real cluster: tests/integration/test_stacks.py."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.cli import main
from launcher.context import Context
from launcher.submit import stacks
from lmcore.run.task_records import TaskRecord, read_task_records, recorded_starts, task_record_path, write_task_record
from lmcore.slurm import client as slurm

PY_SPY = Path(sys.executable).parent / "py-spy"


def _rec(rank: int, node: str, pid: int, python: str = "/venv/bin/python", job: str = "42", restarts: int = 0) -> TaskRecord:
    return TaskRecord(rank=rank, local_rank=0, node=node, pid=pid, job_id=job, restart_count=restarts,
                      python=python, time=1.0)


# --------------------------------------------------------------------------- task records


def test_task_records_round_trip_per_job_start_and_bad_files_are_reported(tmp_path):
    write_task_record(tmp_path, _rec(1, "n2", 222), node=1)
    write_task_record(tmp_path, _rec(0, "n1", 111), node=0)
    write_task_record(tmp_path, _rec(2, "n1", 333), node=0)
    write_task_record(tmp_path, _rec(0, "n1", 999, restarts=1))  # the requeued start of the same job
    path = task_record_path(tmp_path, "42", 0, 0)
    assert path == tmp_path / "logs" / "tasks" / "42-0" / "node-0.jsonl"
    # one file per node, a line per task
    assert sorted(p.name for p in path.parent.iterdir()) == ["node-0.jsonl", "node-1.jsonl"]
    assert len(path.read_text().splitlines()) == 2
    # a rank's process forked again by a restart in place: its newer line is the one read
    write_task_record(tmp_path, dataclasses.replace(_rec(2, "n1", 444), time=2.0), node=0)
    (path.parent / "rank-7.json").write_text('{"rank": 7, "pid": "x"}')  # a record of a run of before: read too
    (path.parent / "rank-5.json").write_text(json.dumps(_rec(5, "n3", 555).to_json()))
    with open(path.parent / "node-1.jsonl", "a") as f:
        f.write('{"rank": 3, "local_rank": 1, "no')  # a task killed in its write

    records, problems = read_task_records(tmp_path, "42", 0)
    assert [(r.rank, r.node, r.pid) for r in records] == [(0, "n1", 111), (1, "n2", 222), (2, "n1", 444), (5, "n3", 555)]
    assert len(problems) == 2, problems
    assert "rank-7.json" in problems[0] and "pid" in problems[0]
    assert "node-1.jsonl:2" in problems[1]
    assert [r.pid for r in read_task_records(tmp_path, "42", 1)[0]] == [999]
    assert read_task_records(tmp_path, "43", 0) == ([], [])
    assert set(recorded_starts(tmp_path)) == {("42", 0), ("42", 1)}


def test_a_task_record_refuses_what_slurm_never_gives():
    with pytest.raises(ValueError, match="job id"):
        task_record_path("/r", "../../etc", 0, 0)
    with pytest.raises(ValueError, match="rank"):
        TaskRecord.from_json({"local_rank": 0, "node": "n1", "pid": 5, "job_id": "1", "restart_count": 0,
                              "python": "p", "time": 1.0})
    with pytest.raises(ValueError, match="pid 0"):
        TaskRecord.from_json({**_rec(0, "n1", 1).to_json(), "pid": 0})
    with pytest.raises(ValueError, match="JSON object"):
        TaskRecord.from_json([1, 2])


def test_the_runtime_records_this_process(tmp_path, monkeypatch):
    from lmtrain.distributed.task_env import record_this_task

    for k, v in {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                 "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                 "SLURM_RESTART_COUNT": "3", "SLURMD_NODENAME": "n2"}.items():
        monkeypatch.setenv(k, v)
    record_this_task(tmp_path)
    [rec], _ = read_task_records(tmp_path, "77", 3)
    assert (rec.rank, rec.node, rec.pid, rec.python) == (1, "n2", os.getpid(), sys.executable)


# --------------------------------------------------------------------------- the srun step


def test_the_step_runs_beside_the_job_one_task_per_node():
    args = slurm.overlap_step_args("42", ["n1", "n2"], ["bash", "-c", "echo hi"])
    assert args[:2] == ["srun", "--overlap"]
    for a in ("--jobid=42", "--nodelist=n1,n2", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--label"):
        assert a in args
    assert args[-3:] == ["bash", "-c", "echo hi"]


def test_labelled_output_of_interleaved_nodes_is_split_per_rank():
    m = stacks.MARK
    out = "\n".join([
        f"0: {m} begin 0 n1", f"1: {m} begin 1 n2", "0: Thread 1 (active)", "1: Thread 9 (idle)",
        "0:     training_step (module.py:10)", f"1: {m} end 1 0", f"0: {m} end 0 0",
        f"0: {m} begin 2 n1", "0: process 5 is gone on n1 (the task exited)", f"0: {m} end 2 3",
        f"1: {m} begin 3 n2", "1: Thread 4",  # the step was cut off here
    ])
    d = stacks.parse_step_output(out)
    assert d[0] == stacks.Dump(0, "n1", 0, "Thread 1 (active)\n    training_step (module.py:10)")
    assert d[1] == stacks.Dump(1, "n2", 0, "Thread 9 (idle)")
    assert (d[2].returncode, d[2].text) == (3, "process 5 is gone on n1 (the task exited)")
    assert (d[3].returncode, d[3].text) == (None, "Thread 4")


def test_every_rank_gets_a_section_with_its_stack_or_why_not():
    m = stacks.MARK
    records = [_rec(0, "n1", 11), _rec(1, "n2", 22), _rec(3, "n2", 44)]
    out = f"0: {m} begin 0 n1\n0: Thread 11\n0:     fit (trainer.py:1)\n0: {m} end 0 0\n"
    secs = stacks.assemble(records, 4, out, step_error="srun: error: n2: task 1: Killed")
    assert [(s.rank, s.node, s.pid) for s in secs] == [(0, "n1", 11), (1, "n2", 22), (2, "?", None), (3, "n2", 44)]
    assert secs[0].stack == "Thread 11\n    fit (trainer.py:1)" and secs[0].error is None
    assert "no answer from node n2: srun: error: n2: task 1: Killed" == secs[1].error
    assert "left no record" in secs[2].error
    text = stacks.format_sections(secs)
    assert "== rank 0 on n1 (pid 11) ==\nThread 11\n    fit (trainer.py:1)\n" in text
    assert "== rank 1 on n2 (pid 22) ==\nerror: no answer from node n2" in text
    assert "== rank 2 on ? (no pid) ==\nerror: " in text
    assert json.loads(json.dumps([s.to_json() for s in secs]))[1] == {
        "rank": 1, "node": "n2", "pid": 22, "stack": None, "error": secs[1].error, "note": None}


# --------------------------------------------------------------------------- the node script, for real


@pytest.fixture
def sleeper():
    """A real Python process waiting in a function with a name to find in its stack."""
    code = textwrap.dedent("""
        import sys, time
        def waiting_in_a_named_frame():
            print("ready", flush=True)
            time.sleep(120)
        waiting_in_a_named_frame()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def _run_node_script(records, node: str, path_env: str | None = None, native: bool = False) -> str:
    script = stacks.node_script(records, native=native, dump_timeout_s=20)
    env = {**os.environ, "SLURMD_NODENAME": node}
    if path_env is not None:
        env["PATH"] = path_env
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(not PY_SPY.exists() or os.geteuid() != 0, reason="py-spy beside this python and root (ptrace) needed")
def test_the_node_script_dumps_its_own_nodes_tasks_and_says_why_others_fail(sleeper):
    gone = subprocess.Popen(["true"])
    gone.wait()
    records = [
        _rec(0, "n1", sleeper.pid, python=sys.executable),
        _rec(1, "n1", gone.pid, python=sys.executable),
        _rec(2, "n1", sleeper.pid, python="/nowhere/bin/python"),  # py-spy neither beside it nor on PATH
        _rec(3, "n2", sleeper.pid, python=sys.executable),  # another node's task: not this node's to dump
    ]
    out = _run_node_script(records, "n1", path_env="/usr/bin:/bin")
    secs = {s.rank: s for s in stacks.assemble(records, 4, out)}
    assert secs[0].error is None and "waiting_in_a_named_frame" in secs[0].stack, out
    assert f"process {gone.pid} is gone on n1" in secs[1].error
    assert "py-spy is not installed on n1" in secs[2].error and "(exit status 127)" in secs[2].error
    assert secs[3].error.startswith("no answer from node n2")

    # with the native frames too; py-spy found on PATH when it is not beside the python
    native = _run_node_script([_rec(0, "n1", sleeper.pid, python="/nowhere/bin/python")], "n1",
                              path_env=f"{PY_SPY.parent}:/usr/bin:/bin", native=True)
    [sec] = stacks.assemble([_rec(0, "n1", sleeper.pid)], 1, native)
    assert sec.error is None and "waiting_in_a_named_frame" in sec.stack
    assert "sleep" in sec.stack.lower()  # the C frame of time.sleep (select/clock_nanosleep)


_FLAKY_SPY = """#!/bin/bash
# a py-spy whose native unwinding fails its first $FAIL_NATIVE tries, as libunwind's does now and then
n=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$COUNT"
case " $* " in *" --native "*) native=1 ;; esac
if [ -n "$native" ] && [ "$n" -le "$FAIL_NATIVE" ]; then
  echo "Error: W_EINVAL: unsupported operation or bad value"; exit 1
fi
[ -n "$FAIL_ALL" ] && { echo "Error: Permission denied"; exit 1; }
echo "Thread $3 (idle)"; echo "    waiting_in_a_named_frame (x.py:4)"
[ -n "$native" ] && echo "    clock_nanosleep (libc.so.6)"
exit 0
"""


@pytest.mark.parametrize(("fail_native", "fail_all", "calls"), [(2, "", 3), (99, "", 4), (99, "1", 4), (0, "1", 1)])
def test_a_native_dump_that_fails_is_tried_again_then_shows_the_python_frames_with_a_note(tmp_path, monkeypatch,
                                                                                         fail_native, fail_all, calls):
    spy = tmp_path / "venv" / "bin" / "py-spy"
    spy.parent.mkdir(parents=True)
    spy.write_text(_FLAKY_SPY)
    spy.chmod(0o755)
    count = tmp_path / "count"
    monkeypatch.setenv("COUNT", str(count))
    monkeypatch.setenv("FAIL_NATIVE", str(fail_native))
    monkeypatch.setenv("FAIL_ALL", fail_all)
    rec = _rec(0, "n1", os.getpid(), python=str(spy.parent / "python"))
    out = _run_node_script([rec], "n1", native=bool(fail_native) or not fail_all)
    [sec] = stacks.assemble([rec], 1, out)
    assert int(count.read_text()) == calls, out
    if fail_all:  # py-spy cannot read the process at all: an error, with what py-spy said
        assert sec.stack is None and "Permission denied" in sec.error and "(exit status 1)" in sec.error, sec
        assert fail_native == 0 or "W_EINVAL" in sec.error and "without --native: Error: Permission" in sec.error
    elif fail_native == 2:  # the third try unwound it: native frames, no note
        assert sec.note is None and "clock_nanosleep" in sec.stack and "waiting_in_a_named_frame" in sec.stack
    else:  # never: the Python frames, with a note saying why the native ones are missing
        assert sec.error is None and "waiting_in_a_named_frame" in sec.stack and "clock_nanosleep" not in sec.stack
        assert sec.note == ("native frames unavailable after 3 tries (py-spy: Error: W_EINVAL: unsupported "
                            "operation or bad value): Python frames only")
        text = stacks.format_sections([sec])
        assert text.startswith(f"== rank 0 on n1 (pid {os.getpid()}) ==\nnote: native frames unavailable"), text
        assert sec.to_json()["note"] == sec.note


def test_hostile_node_names_and_paths_stay_data_in_the_script(tmp_path):
    canary = tmp_path / "canary"
    records = [_rec(0, f"n1'; touch {canary}; '", 1, python=f"/x $(touch {canary})/python")]
    out = _run_node_script(records, "n9")
    assert not canary.exists()
    assert f"{stacks.MARK} stray n9" in out


# --------------------------------------------------------------------------- the command's own errors


def test_a_run_without_a_slurm_job_is_refused_with_exit_2(tmp_path):
    run_dir = tmp_path / "local-run"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text(json.dumps({"run_name": "local-run", "profile": "local"}))
    out, err = io.StringIO(), io.StringIO()
    env = {**os.environ, "LMLAUNCH_HOME": str(tmp_path / "home")}
    t0 = time.monotonic()
    code = main(["stacks", str(run_dir)], Context(stdout=out, stderr=err, environ=env))
    assert code == 2 and "has no SLURM job" in err.getvalue(), err.getvalue()
    assert time.monotonic() - t0 < 10

    # a local run (`lmlaunch run --local`) recorded its tasks: the message names their pids
    write_task_record(run_dir, _rec(0, "vm", 4242, job="local-7-1700000000"))
    err = io.StringIO()
    code = main(["stacks", str(run_dir)], Context(stdout=out, stderr=err, environ=env))
    assert code == 2 and "runs locally" in err.getvalue() and "rank 0: pid 4242" in err.getvalue(), err.getvalue()


def test_the_command_is_listed_and_completed():
    import argparse

    from launcher.cli import build_parser
    from launcher.commands import COMMANDS, completion

    assert "stacks" in COMMANDS
    parser = build_parser(only="stacks")
    completion.attach(parser)
    stacks = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["stacks"]
    run = next(a for a in stacks._actions if a.dest == "run")
    assert run.completer is completion.run_names and any("--native" in a.option_strings for a in stacks._actions)
