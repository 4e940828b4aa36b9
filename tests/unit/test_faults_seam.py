"""lmtrain.faults: the one fault-injection seam. Off unless the harness turns it on; a job spec
or a cluster profile cannot; rules match points by name, file, rank, step and count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import waiting

from lmtrain import faults


@pytest.fixture(autouse=True)
def _off_again():
    yield
    faults.load("")
    faults.set_context(step=None)


def test_off_by_default_points_cost_nothing_and_count_nothing():
    faults.load("")
    faults.point("checkpoint.renamed", file="COMPLETE")
    assert faults.seen() == 0


def test_rules_match_by_name_file_rank_step_and_count():
    faults.load(json.dumps([{"point": "checkpoint.*", "action": "count"}]))
    faults.set_context(step=7)
    for name, file in [("checkpoint.wrote", "meta.json"), ("checkpoint.renamed", "meta.json"), ("train.batch_end", "")]:
        faults.point(name, file=file)
    assert faults.seen("checkpoint.*") == 2 and faults.seen() == 3 and faults.seen("train.*") == 1


def _child(rules: list[dict], calls: list[tuple[str, dict]]) -> int:
    """Run the points in a forked child with the rules; its wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            faults.load(json.dumps(rules))
            for name, fields in calls:
                faults.point(name, **fields)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


@pytest.mark.parametrize("rule, killed", [
    ({"point": "checkpoint.renamed", "file": "COMPLETE"}, True),
    ({"point": "checkpoint.renamed", "file": "latest"}, False),
    ({"point": "checkpoint.*", "nth": 3}, True),
    ({"point": "checkpoint.*", "nth": 4}, False),
    ({"point": "checkpoint.renamed", "rank": 1}, True),
    ({"point": "checkpoint.renamed", "rank": 2}, False),
    ({"point": "checkpoint.renamed", "step": 20}, True),
    ({"point": "checkpoint.renamed", "step": 30}, False),
])
def test_a_kill_rule_fires_only_where_every_field_matches(rule, killed):
    calls = [("checkpoint.wrote", {"file": "COMPLETE", "rank": 1, "step": 20}),
             ("checkpoint.fsynced", {"file": "COMPLETE", "rank": 1, "step": 20}),
             ("checkpoint.renamed", {"file": "COMPLETE", "rank": 1, "step": 20})]
    status = _child([{**rule, "action": "kill"}], calls)
    assert (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL) == killed, status


def test_the_attempt_comes_from_the_ledger(tmp_path, monkeypatch):
    from lmcore.run.rundir import AttemptStart, Ledger

    monkeypatch.setenv("LMLAUNCH_RUN_DIR", str(tmp_path))
    ledger = Ledger(tmp_path / "attempts.jsonl")
    for n in (1, 2):
        ledger.write(AttemptStart(attempt=n, job_id="7", restart_count=n - 1, time=0.0, start_step=0, nodes=[], world_size=1))
    assert _child([{"point": "x", "attempt": 1, "action": "kill"}], [("x", {})]) == 0
    assert os.WTERMSIG(_child([{"point": "x", "attempt": 2, "action": "kill"}], [("x", {})])) == signal.SIGKILL


def test_a_gate_holds_the_process_at_its_point_until_its_file_exists(tmp_path):
    gate, passed = tmp_path / "open", tmp_path / "passed"
    pid = os.fork()
    if pid == 0:
        try:
            faults.load(json.dumps([{"point": "train.batch_end", "step": 3, "action": "gate", "until": str(gate)}]))
            for step in (1, 2, 3):
                faults.point("train.batch_end", step=step)
                (tmp_path / f"step-{step}").touch()
            passed.touch()
        finally:
            os._exit(0)
    try:
        # held at step 3: its two steps before passed, and it stays there while the file is absent
        # (a sign of life the test watches: the process sleeps in the gate's poll, alive, not past it)
        waiting.until(lambda: (tmp_path / "step-2").exists(), progress=waiting.process_cpu(pid), what="the steps before the gate")
        for _ in range(20):
            assert os.waitpid(pid, os.WNOHANG) == (0, 0) and not (tmp_path / "step-3").exists()
            time.sleep(faults.GATE_POLL_S)
        gate.touch()
        assert os.waitpid(pid, 0)[1] == 0 and passed.exists()
    finally:
        if not passed.exists():
            os.kill(pid, signal.SIGKILL)


def test_a_gate_opens_when_lmtrains_handler_is_told_to_stop(tmp_path):
    """A run held at a point and then preempted goes on to its stop: the signal opens the gate."""
    from lmtrain.preemption.signals import SignalOwner, StopRequest

    passed = tmp_path / "passed"
    pid = os.fork()
    if pid == 0:
        try:
            stop = StopRequest()
            SignalOwner(stop).install()
            faults.load(json.dumps([{"point": "p", "action": "gate"}]))  # no file: a stop opens it
            (tmp_path / "held").touch()
            faults.point("p")
            if stop.requested and stop.reason == "preempted":
                passed.touch()
        finally:
            os._exit(0)
    try:
        waiting.until(lambda: (tmp_path / "held").exists(), progress=waiting.process_cpu(pid), what="the gate reached")
        os.kill(pid, signal.SIGTERM)
        assert os.waitpid(pid, 0)[1] == 0 and passed.exists()
    finally:
        if not passed.exists():
            os.kill(pid, signal.SIGKILL)


def test_a_bad_rule_is_refused():
    with pytest.raises(ValueError, match="bad rule"):
        faults.load(json.dumps([{"point": "x", "action": "explode"}]))
    with pytest.raises(ValueError, match="bad rule"):
        faults.load(json.dumps([{"point": "x", "action": "kill", "when": "now"}]))
    with pytest.raises(ValueError, match="'until' only with 'gate'"):
        faults.load(json.dumps([{"point": "x", "action": "kill", "until": "/tmp/f"}]))


def test_only_a_task_process_reads_the_environment_at_import():
    rules = json.dumps([{"point": "*", "action": "count"}])
    code = "from lmtrain import faults; faults.point('p'); print(faults.seen())"
    base = {k: v for k, v in os.environ.items() if k != "LMLAUNCH_RUN_DIR"}
    cli = subprocess.run([sys.executable, "-c", code], env={**base, "LMLAUNCH_FAULTS": rules},
                         capture_output=True, text=True, check=True)
    task = subprocess.run([sys.executable, "-c", code], env={**base, "LMLAUNCH_FAULTS": rules, "LMLAUNCH_RUN_DIR": "/x"},
                          capture_output=True, text=True, check=True)
    assert cli.stdout.split()[-1] == "0" and task.stdout.split()[-1] == "1"


@pytest.mark.parametrize("override", [
    "env.vars.LMLAUNCH_FAULTS=/tmp/faults.json",
    "env.passthrough=[LMLAUNCH_FAULTS]",
    "env.vars.LMTRAIN_ANYTHING=1",
])
def test_a_job_spec_cannot_turn_it_on(repo, override, tmp_path):
    import io

    from launcher.cli import main
    from launcher.context import Context

    out = io.StringIO()
    code = main(["validate", str(repo / "jobs" / "tiny-cpu.yaml"), override],
                Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(tmp_path)}))
    assert code == 4, out.getvalue()
    assert "may not be set by a job" in out.getvalue() and "belong to lmlaunch" in out.getvalue(), out.getvalue()


def test_a_cluster_profile_cannot_turn_it_on():
    from launcher.spec.profiles import Profile

    with pytest.raises(ValueError, match="LMLAUNCH_FAULTS may not be set by a cluster profile"):
        Profile.model_validate({
            "name": "p", "python": "python3", "runs_root": "/r", "gpus_per_node": 0,
            "partitions": {"a": {"max_time": "1:00:00"}}, "default_partition": "a",
            "env": {"LMLAUNCH_FAULTS": {"value": "/tmp/f.json", "why": "x"}},
        })
