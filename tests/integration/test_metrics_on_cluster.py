"""Debian's `prometheus` scrapes `lmlaunch metrics serve` while a real 2-node tiny job trains and is
preempted on the local cluster: Prometheus' HTTP API gives the run's step, loss, state, per-rank
step timing and, after the preemption, the preempted attempt and the next one; and every PromQL
expression of the shipped Grafana dashboard (launcher.grafana) returns series for the run (the
DCGM-joined ones and MFU evaluate without error and return nothing here: no NVIDIA DCGM exporter
runs on this machine, and a CPU has no known peak FLOPs). Grafana's own server is not installable here (no package in Debian's archive)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import waiting
from preempt_helpers import preempt, run_progress, submit, wait_attempt_running, wait_step
from waiting import HANG_S

from launcher.grafana import DEVICE_ONLY, EXPRESSIONS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_follows_a_preempted_job_and_every_dashboard_query_answers(slurm_cluster, lm_env, run_name,
                                                                              own_jobs, tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus is missing: scripts/setup.sh installs it (as root)"
    job_id, run_dir = submit(lm_env, run_name, "trainer.max_steps=100000", "trainer.log_every_n_steps=2",
                             "health.stragglers.min_interval_s=0")
    own_jobs.append(job_id)
    port, web = _free_port(), _free_port()
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--listen",
                              f"127.0.0.1:{port}", "--seconds", "1800"], env=lm_env, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "serve.log", "w"))
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: lmlaunch\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    server = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "prometheus.log", "w"))

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=HANG_S) as r:
                answer = json.loads(r.read())
        except OSError:
            return []
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def until(expr: str, ok, what: str):
        return waiting.until(lambda: (lambda got: got if got and ok(got) else None)(query(expr)), what=what,
                             progress=waiting.watching(run_progress(run_dir, job_id), waiting.process_cpu(server.pid)),
                             explain=lambda: f"{query(expr)}\n{(tmp_path / 'serve.log').read_text()[-1500:]}")

    run = f'run="{run_name}"'
    try:
        wait_step(run_dir, 6, job_id=job_id)
        until(f"lmlaunch_run_step{{{run}}}", lambda g: float(g[0]["value"][1]) >= 6, "the run's step scraped")
        state = until(f'lmlaunch_run_info{{{run}, group="running"}}', bool, "the run scraped as running")
        assert state[0]["metric"]["job_id"] == job_id and state[0]["metric"]["state"] == "RUNNING"
        assert float(query(f"lmlaunch_run_train_loss{{{run}}}")[0]["value"][1]) > 0
        ranks = until(f'lmlaunch_rank_step_seconds{{{run}, part="forward"}}', lambda g: len(g) == 2,
                      "both ranks' step timing scraped")
        assert sorted((r["metric"]["rank"], r["metric"]["node"]) for r in ranks) == [("0", "n1"), ("1", "n2")]

        # preempted and requeued: Prometheus sees the ended attempt and the next one
        assert preempt(lm_env, run_name, "requeue", "--start-now")["requeued"]
        wait_attempt_running(run_dir, 2, job_id)
        until(f'lmlaunch_run_attempts_ended_total{{{run}, reason="preempted"}}', lambda g: float(g[0]["value"][1]) == 1,
              "the preempted attempt scraped")
        until(f"lmlaunch_run_attempt{{{run}}}", lambda g: float(g[0]["value"][1]) == 2, "attempt 2 scraped")
        assert float(query(f"lmlaunch_run_attempts_started_total{{{run}}}")[0]["value"][1]) == 2
        until(f'lmlaunch_rank_compute_ratio{{{run}}}', lambda g: len(g) == 2, "both ranks' compute ratio scraped")

        # every query of the dashboard, with its run variable set to this run
        for expr in EXPRESSIONS:
            got = query(expr.replace("$run", run_name))
            if expr in DEVICE_ONLY:  # DCGM's GPUs, a GPU's MFU: none here; the query evaluates, answers nothing
                assert got == [], (expr, got)
            else:
                assert got and all(s["metric"].get("run") == run_name for s in got if "run" in s["metric"]), expr
    finally:
        server.terminate()
        serve.terminate()
        server.wait(timeout=HANG_S)
        serve.wait(timeout=HANG_S)
    assert not any(p.name.endswith(".prom") for p in run_dir.rglob("*"))  # the exporter wrote nothing there
