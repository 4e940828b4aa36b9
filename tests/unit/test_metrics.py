"""`lmlaunch metrics`: the runs as Prometheus metrics, read back by prometheus_client's own parser
and scraped by a real Prometheus server (Debian's `prometheus`, started here on a loopback port)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import waiting
from monitor_synth import T0, make_run
from prometheus_client.parser import text_string_to_metric_families
from prometheus_server import free_port, prometheus
from waiting import HANG_S

from launcher.cli import main
from launcher.context import Context
from launcher.monitor import status_rows as monitor
from launcher.monitor.run_files import read_run_files
from launcher.runs import registry as runs
from launcher.serve import exporter as metrics

JOB = "999999901"  # no cluster has this job: the rows come from the run directories


def _runs(home: Path) -> None:
    make_run(home, "train", job_ids=(JOB,), max_steps=100, checkpoint_step=40, attempts=[
        {"job_id": JOB, "start_step": 0, "end_step": 30, "t0": T0 - 300, "t1": T0 - 200, "reason": "preempted",
         "requeued": True},
        {"job_id": JOB, "start_step": 30, "end_step": 60, "t0": T0 - 150, "t1": T0 - 10}])
    make_run(home, "done", job_ids=("999999902",), max_steps=20, markers=("DONE",), attempts=[
        {"job_id": "999999902", "start_step": 0, "end_step": 20, "t0": T0 - 100, "t1": T0 - 50, "reason": "completed"}])


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_each_run_is_a_labelled_series_of_what_status_shows(tmp_path):
    _runs(tmp_path)
    env = {"LMLAUNCH_HOME": str(tmp_path)}
    records = runs.list_records(env)
    files = [read_run_files(Path(r.run_dir)) for r in records]
    rows = [monitor.build_row(r, f, None, slurm_reachable=True, now=T0) for r, f in zip(records, files)]
    from prometheus_client import CollectorRegistry, generate_latest

    class Static:
        def collect(self):
            return metrics.families(rows, [f.ledger for f in files], slurm_reachable=True)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Static())
    got = _samples(generate_latest(registry).decode())
    run = (("run", "train"),)
    assert got[("lmlaunch_run_step", run)] == 60 and got[("lmlaunch_run_max_steps", run)] == 100
    assert got[("lmlaunch_run_train_loss", run)] == pytest.approx(5.0 - 0.02 * 60)
    assert got[("lmlaunch_run_tokens_per_second", run)] == pytest.approx(5060.0)
    assert got[("lmlaunch_run_checkpoint_step", run)] == 40
    assert got[("lmlaunch_run_checkpoint_age_seconds", run)] == pytest.approx(90, abs=1)
    assert got[("lmlaunch_run_attempts_started_total", run)] == 2
    assert got[("lmlaunch_run_attempts_ended_total", (("reason", "preempted"), ("run", "train")))] == 1
    assert got[("lmlaunch_run_attempts_ended_total", (("reason", "completed"), ("run", "done")))] == 1
    info = {labels: v for (name, labels), v in got.items() if name == "lmlaunch_run_info"}
    assert {dict(k)["run"]: dict(k)["group"] for k in info} == {"train": "unknown", "done": "completed"}
    assert got[("lmlaunch_slurm_up", ())] == 1 and got[("lmlaunch_runs", (("group", "completed"),))] == 1


def _lm(env: dict, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), Context(stdout=out, stderr=err, environ=env))
    return code, out.getvalue(), err.getvalue()


def test_write_leaves_one_prom_file_for_the_textfile_collector_and_bad_input_is_said(tmp_path):
    _runs(tmp_path / "home")
    env = {"LMLAUNCH_HOME": str(tmp_path / "home")}
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "home" / "runs").rglob("*"))
    (tmp_path / "textfile").mkdir()
    code, out, err = _lm(env, "metrics", "write", str(tmp_path / "textfile"))
    assert code == 0, err
    assert [p.name for p in (tmp_path / "textfile").iterdir()] == ["lmlaunch.prom"]  # no temporary file left
    got = _samples((tmp_path / "textfile" / "lmlaunch.prom").read_text())
    assert got[("lmlaunch_run_step", (("run", "train"),))] == 60
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "home" / "runs").rglob("*")) == before  # read only
    code, _, err = _lm(env, "metrics", "write", str(tmp_path / "missing"))
    assert code == 2 and "not a directory" in err
    for bad in ("abc:x", "127.0.0.1:0", "127.0.0.1:70000", ""):
        code, _, err = _lm(env, "metrics", "serve", "--refresh", "1", "--listen", bad)
        assert code == 2 and "expected HOST:PORT or PORT" in err, (bad, err)


def test_a_real_prometheus_scrapes_the_exporter_and_a_taken_port_is_said(tmp_path):
    _runs(tmp_path / "home")
    env = {"LMLAUNCH_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    port, token_file = free_port(), tmp_path / "home" / "metrics.token"  # the default: made at the first start
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--refresh", "1", "--listen",
                              f"127.0.0.1:{port}",
                              "--seconds", "600"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waiting.until(lambda: token_file.is_file() and token_file.read_text().strip(), what="the exporter's token file",
                      progress=waiting.watching(waiting.process_cpu(serve.pid)))
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        _scrape_needs_the_token(port, token_file.read_text().strip())
        with prometheus([f"127.0.0.1:{port}"], tmp_path, token_file=token_file) as (server, query):
            step = waiting.until(lambda: query('lmlaunch_run_step{run="train"}'), what="Prometheus' scrape of the run",
                                 progress=waiting.watching(waiting.process_cpu(server.pid),
                                                           waiting.process_cpu(serve.pid)),
                                 explain=lambda: (tmp_path / "prometheus.log").read_text()[-2000:])
            assert float(step[0]["value"][1]) == 60 and step[0]["metric"]["job"] == "lmlaunch"
            ended = query('lmlaunch_run_attempts_ended_total{reason="preempted"}')
            assert [(e["metric"]["run"], float(e["value"][1])) for e in ended] == [("train", 1.0)]
            assert [e["metric"]["run"] for e in query('lmlaunch_run_info{group="completed"}')] == ["done"]
            # the same port again: a clear error, not a traceback
            taken = subprocess.run([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--refresh", "1", "--listen",
                                    f"127.0.0.1:{port}", "--seconds", "1"], env=env, capture_output=True, text=True,
                                   timeout=HANG_S)
            assert taken.returncode == 2 and "the port is in use" in taken.stderr, taken.stderr
    finally:
        serve.terminate()
        serve.wait(timeout=HANG_S)


def _scrape_needs_the_token(port: int, token: str) -> None:
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{port}/metrics"
    for header in (None, "Bearer wrong", f"Basic {token}"):
        request = urllib.request.Request(url, headers={"Authorization": header} if header else {})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=HANG_S)
        assert refused.value.code == 401 and "Bearer" in refused.value.headers["WWW-Authenticate"]
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=HANG_S) as answer:
        assert answer.status == 200 and b"lmlaunch_run_step" in answer.read()


def test_the_token_file_is_private_and_the_choice_said(tmp_path):
    env = {"LMLAUNCH_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    open_file = tmp_path / "open.token"
    open_file.write_text("abc\n")
    open_file.chmod(0o644)
    for extra, said in ((["--token-file", str(open_file)], "others on this machine can read it (mode 644)"),
                        (["--token-file", str(tmp_path / "none" / "t")], "the directory"),
                        (["--token-file", str(open_file), "--no-token"], "exclude each other")):
        code, _, err = _lm(env, "metrics", "serve", "--listen", f"127.0.0.1:{free_port()}", "--seconds", "0.1", *extra)
        assert code == 2 and said in err, (extra, err)
    assert open_file.read_text() == "abc\n"  # nothing rewritten
    code, out, err = _lm(env, "metrics", "serve", "--listen", f"127.0.0.1:{free_port()}", "--seconds", "0.1", "--no-token")
    assert code == 0 and "--no-token: every user who reaches the address" in err, err


def test_a_running_runs_ranks_are_series_of_their_own_from_rank_0s_summary(tmp_path):
    from lmcore.run.rundir import RunLayout

    run_dir = tmp_path / "r"
    (run_dir / "metrics").mkdir(parents=True)
    RunLayout.of(run_dir).rank_times.write_text(json.dumps({"attempt": 1, "step": 40, "ranks": {
        "0": {"node": "n1", "step": 40, "vs_peers": 1.0, "slow": False, "data": 0.01, "forward": 0.1, "backward": 0.3,
              "optimizer": 0.02, "boundary": 0.05},
        "1": {"node": "n2", "step": 40, "vs_peers": 1.9, "slow": True, "data": 0.01, "forward": 0.19,
              "backward": 0.21, "optimizer": 0.02, "boundary": 0.0}}, "slow": []}))
    row = monitor.StatusRow(name="r", job_id="5", state="RUNNING", group="running", reason=None, requeued=False,
                            nodes=2, elapsed=None, time_limit=None, attempt=1, step=40, max_steps=100, loss=None,
                            tokens_per_s=None, mfu=None, checkpoint_step=None, checkpoint_age_s=None, eta_s=None,
                            heartbeat_age_s=None, run_dir=str(run_dir), job_ids=["5"])
    ended = monitor.StatusRow(**{**row.__dict__, "name": "old", "group": "completed", "state": "COMPLETED"})
    got = {}
    for family in metrics.rank_families([row, ended]):
        for s in family.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert got[("lmlaunch_rank_step_seconds", (("node", "n2"), ("part", "forward"), ("rank", "1"), ("run", "r")))] == 0.19
    assert got[("lmlaunch_rank_compute_ratio", (("node", "n2"), ("rank", "1"), ("run", "r")))] == 1.9
    assert got[("lmlaunch_rank_slow", (("node", "n2"), ("rank", "1"), ("run", "r")))] == 1.0
    assert got[("lmlaunch_rank_slow", (("node", "n1"), ("rank", "0"), ("run", "r")))] == 0.0
    assert got[("lmlaunch_run_slow_ranks", (("run", "r"),))] == 1
    assert not any(dict(k).get("run") == "old" for _, k in got)  # only while it runs
    RunLayout.of(run_dir).rank_times.write_text('{"ranks": {"0": {"node": "n1", "for')  # half-written: skipped
    assert all(not f.samples for f in metrics.rank_families([row]))


def test_the_grafana_dashboard_is_written_once_with_every_query_and_a_run_variable(tmp_path):
    from launcher.serve.grafana import EXPRESSIONS

    target = tmp_path / "board.json"
    code, out, err = _lm({}, "metrics", "dashboard", "-o", str(target))
    assert code == 0, err
    board = json.loads(target.read_text())
    assert [t["expr"] for p in board["panels"] for t in p["targets"]] == list(EXPRESSIONS)
    assert {v["name"] for v in board["templating"]["list"]} == {"run", "datasource"}
    assert all('run=~"$run"' in e for e in EXPRESSIONS)
    assert any(p["type"] == "heatmap" and "lmlaunch_rank_step_seconds" in p["targets"][0]["expr"] for p in board["panels"])
    code, _, err = _lm({}, "metrics", "dashboard", "-o", str(target))
    assert code == 2 and "exists: lmlaunch keeps it" in err
    target.write_text("mine")
    assert _lm({}, "metrics", "dashboard", "-o", str(target), "--force")[0] == 0 and target.read_text() != "mine"


def test_a_scrape_is_answered_from_the_newest_reading_and_a_failed_reading_keeps_the_last_good_one():
    import threading

    readings = []
    release = threading.Event()

    def render() -> bytes:
        readings.append(len(readings))
        if len(readings) == 2:
            raise OSError("a run directory vanished mid-read")
        if len(readings) >= 3:
            release.wait()
        return f"lmlaunch_runs {len(readings)}\n".encode()

    snapshots = metrics.Snapshots(render, pause_s=0.0).start()
    try:
        first = metrics.with_age(*snapshots.answer()).decode()  # waits for the first reading
        assert first.startswith("lmlaunch_runs 1\n") and "lmlaunch_exporter_snapshot_age_seconds " in first
        waiting.until(lambda: len(readings) >= 3 or None, what="the third reading",
                      progress=waiting.watching(lambda: len(readings)))
        assert snapshots.answer()[0].decode().startswith("lmlaunch_runs 1\n")  # the failed one left it as it was
        assert snapshots.error is None or "vanished" in snapshots.error
    finally:
        snapshots.stop()
        release.set()


def test_a_first_reading_that_hangs_is_answered_come_back_not_held():
    hung = threading.Event()
    snapshots = metrics.Snapshots(lambda: hung.wait() and b"", pause_s=0.0).start()  # a hung filesystem at start
    try:
        assert snapshots.answer(first_wait_s=0.2) is None  # not held: the exporter answers 503 with Retry-After
    finally:
        snapshots.stop()
        hung.set()


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("0.0.0.0", True), ("10.1.2.3", True)])
def test_a_server_listening_beyond_loopback_says_so(host, warned):
    from launcher.serve import http_serve

    said = http_serve.exposure(host, "dashboard")
    assert (said is not None) == warned and (not warned or "reachable beyond this machine" in said)


def test_steps_lost_queue_wait_and_memory_held_come_from_the_ledger():
    ledger = [
        {"event": "start", "attempt": 1, "start_step": 0},
        {"event": "end", "attempt": 1, "end_step": 47, "reason": "crashed", "restart": "in_place"},
        {"event": "start", "attempt": 2, "start_step": 40},  # the checkpoint at 40: 7 steps again
        {"event": "memory", "attempt": 2, "held": [{"params": 10, "grads": 10, "optimizer": 20},
                                                   {"params": 12, "grads": 12, "optimizer": 24}], "device_peak": [900, 950]},
        {"event": "end", "attempt": 2, "end_step": 60},
        {"event": "start", "attempt": 3, "start_step": 60},  # the stop checkpoint: nothing lost
        {"event": "start", "attempt": 4, "start_step": 50},  # attempt 3 killed without an end line: not counted
    ]
    assert metrics.steps_lost(ledger) == 7
    timed = [{"event": "start", "attempt": 1, "job_id": "5", "time": 100.0}, {"event": "end", "attempt": 1, "time": 200.0},
             {"event": "start", "attempt": 2, "job_id": "5", "time": 230.0},  # requeued: 30 s after the end line
             {"event": "end", "attempt": 2, "time": 300.0},
             {"event": "start", "attempt": 3, "job_id": "6", "time": 410.0}]  # resubmitted at 400: 10 s
    assert metrics.queue_wait_s(timed, {"5": 90.0, "6": 400.0}) == 10 + 30 + 10
    row = monitor.build_row(runs.RunRecord(name="r", profile="local", run_dir="/nonexistent", spec_path="/s.yaml",
                                           job_ids=["1"]),
                            read_run_files(Path("/nonexistent")), None, slurm_reachable=True, now=T0)
    got = _samples_of(metrics.families([row], [ledger], slurm_reachable=True, submitted=[{}]))
    assert got[("lmlaunch_run_steps_lost_total", (("run", "r"),))] == 7
    assert got[("lmlaunch_run_restarts_in_place_total", (("run", "r"),))] == 1
    assert got[("lmlaunch_run_model_states_held_bytes", (("run", "r"),))] == 48  # the rank that held most
    assert got[("lmlaunch_run_device_peak_bytes", (("run", "r"),))] == 950


def test_goodput_and_planned_memory_come_from_the_ledger():
    """Training over allocated seconds, attempt by attempt: from the start line (allocated) or the
    first step (training: the startup line's process start plus its first_step phase) to the end
    line, the newest to now while the run runs; an attempt killed without an end line is left out."""
    def startup(n, at, first_step):
        return {"event": "startup", "attempt": n, "process_start": at, "phases": {"first_step": first_step}}

    ledger = [
        {"event": "start", "attempt": 1, "time": 100.0}, startup(1, 98.0, 12.0), {"event": "end", "attempt": 1, "time": 200.0},
        {"event": "start", "attempt": 2, "time": 300.0}, startup(2, 299.0, 21.0),  # killed: no end line
        {"event": "start", "attempt": 3, "time": 400.0}, startup(3, 400.0, 50.0),
        {"event": "memory", "attempt": 3, "held": [{"params": 1, "grads": 1, "optimizer": 2}],
         "planned": {"model_states": 4, "peak": 4096, "world_size": 1}},
    ]
    # attempt 1: 100 s held, 90 trained (from 110); attempt 2 left out; attempt 3 running: 100 held, 50 trained
    assert metrics.goodput_seconds(ledger, running=True, now=500.0) == (90.0 + 50.0, 100.0 + 100.0)
    assert metrics.goodput_seconds(ledger, running=False, now=500.0) == (90.0, 100.0)  # 3 ended without a line
    assert metrics.goodput_seconds([], running=True, now=1.0) == (0.0, 0.0)
    # a restart in place holds the nodes between its end line and the next start: allocated, not trained
    in_place = [{**ledger[2], "restart": "in_place"}] + [e for e in ledger[3:] if e.get("attempt") == 3]
    restarted = ledger[:2] + in_place
    assert metrics.goodput_seconds(restarted, running=True, now=500.0) == (90.0 + 50.0, 100.0 + 200.0 + 100.0)
    assert metrics.goodput_seconds(ledger[:2] + in_place[:1], running=True, now=250.0) == (90.0, 100.0 + 50.0)
    row = monitor.build_row(runs.RunRecord(name="r", profile="local", run_dir="/nonexistent", spec_path="/s.yaml",
                                           job_ids=["1"]),
                            read_run_files(Path("/nonexistent")), None, slurm_reachable=True, now=T0)
    got = _samples_of(metrics.families([row], [ledger], slurm_reachable=True, submitted=[{}], now=500.0))
    assert got[("lmlaunch_run_training_seconds_total", (("run", "r"),))] == 90.0  # the row is not running
    assert got[("lmlaunch_run_allocated_seconds_total", (("run", "r"),))] == 100.0
    assert got[("lmlaunch_run_goodput_ratio", (("run", "r"),))] == 0.9
    assert got[("lmlaunch_run_model_states_planned_bytes", (("run", "r"),))] == 4
    assert got[("lmlaunch_run_device_peak_planned_bytes", (("run", "r"),))] == 4096
    assert got[("lmlaunch_run_model_states_held_bytes", (("run", "r"),))] == 4
    empty = _samples_of(metrics.families([row], [[]], slurm_reachable=True, submitted=[{}], now=500.0))
    assert ("lmlaunch_run_goodput_ratio", (("run", "r"),)) not in empty  # nothing allocated: no ratio
    assert ("lmlaunch_run_model_states_planned_bytes", (("run", "r"),)) not in empty


def test_a_preparation_on_the_cluster_exports_its_documents_and_tokens():
    """`data prepare --on-cluster`'s heartbeat lines (the newest with figures; a training run has none)."""
    row = monitor.build_row(runs.RunRecord(name="prep", profile="local", run_dir="/nonexistent", spec_path="/s.yaml",
                                           job_ids=["1"]),
                            read_run_files(Path("/nonexistent")), None, slurm_reachable=True, now=T0)
    beats = [{"event": "step", "step": 1, "max_steps": 4, "documents": 10, "tokens": 900, "task": 0},
             {"event": "step", "step": 2, "max_steps": 4, "documents": 25, "tokens": 2100, "task": 1},
             {"event": "heartbeat"}]
    got = _samples_of(metrics.families([row, row], [[], []], slurm_reachable=True, submitted=[{}, {}],
                                       heartbeats=[beats, [{"event": "step", "step": 3, "loss": 2.0}]]))
    assert got[("lmlaunch_run_prepared_documents", (("run", "prep"),))] == 25
    assert got[("lmlaunch_run_prepared_tokens", (("run", "prep"),))] == 2100
    assert metrics.preparation_progress([{"event": "step", "step": 3, "loss": 2.0}]) is None


def _samples_of(families) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    class Static:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Static())
    return _samples(generate_latest(registry).decode())
