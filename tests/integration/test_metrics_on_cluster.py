"""Debian's `prometheus` scrapes `lmlaunch metrics serve` while a real 2-node tiny job trains and is
preempted on the local cluster: Prometheus' HTTP API gives the run's step, loss, state, per-rank
step timing and, after the preemption, the preempted attempt and the next one; and every PromQL
expression of the shipped Grafana dashboard (launcher.serve.grafana) returns series for the run (the
DCGM-joined ones and MFU evaluate without error and return nothing here: no NVIDIA DCGM exporter
runs on this machine, and a CPU has no known peak FLOPs). Grafana's own server is not installable here (no package in Debian's archive)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import waiting
from preempt_helpers import ledger, preempt, run_progress, submit, wait_attempt_running, wait_step
from prometheus_server import free_port, prometheus
from waiting import HANG_S

from launcher.serve.grafana import DEVICE_ONLY, EXPRESSIONS, WAITING_ONLY


def test_prometheus_follows_a_preempted_job_and_every_dashboard_query_answers(slurm_cluster, lm_env, run_name,
                                                                              own_jobs, tmp_path):
    job_id, run_dir = submit(lm_env, run_name, "trainer.max_steps=100000", "trainer.log_every_n_steps=2",
                             "health.stragglers.min_interval_s=0")
    own_jobs.append(job_id)
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--refresh", "1", "--listen",
                              f"127.0.0.1:{port}", "--seconds", "1800"], env=lm_env, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "serve.log", "w"))
    try:
        token_file = Path(lm_env["LMLAUNCH_HOME"]) / "metrics.token"  # made by serve at its start (mode 0600)
        waiting.until(lambda: token_file.is_file() and token_file.read_text().strip(), what="the exporter's token file",
                      progress=waiting.watching(waiting.process_cpu(serve.pid)))
        with prometheus([f"127.0.0.1:{port}"], tmp_path, token_file=token_file) as (server, query):
            _follow(query, server, run_name, job_id, run_dir, tmp_path, lm_env)
    finally:
        serve.terminate()
        serve.wait(timeout=HANG_S)
    assert not any(p.name.endswith(".prom") for p in run_dir.rglob("*"))  # the exporter wrote nothing there


def _follow(query, server, run_name, job_id, run_dir, tmp_path, lm_env) -> None:
    def until(expr: str, ok, what: str):
        return waiting.until(lambda: (lambda got: got if got and ok(got) else None)(query(expr)), what=what,
                             progress=waiting.watching(run_progress(run_dir, job_id), waiting.process_cpu(server.pid)),
                             explain=lambda: f"{query(expr)}\n{(tmp_path / 'serve.log').read_text()[-1500:]}")

    run = f'run="{run_name}"'
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
    until(f"lmlaunch_run_attempts_started_total{{{run}}}", lambda g: float(g[0]["value"][1]) == 2,
          "attempt 2's start line scraped")  # the ledger's line, which may follow SLURM's restart count
    resumed_at = max(int(e["start_step"]) for e in ledger(run_dir) if e.get("event") == "start")
    wait_step(run_dir, resumed_at + 6, attempt=2, job_id=job_id)  # attempt 2's own throughput and timing
    until(f"lmlaunch_run_tokens_per_second{{{run}}}", bool, "attempt 2's throughput scraped")
    until(f'lmlaunch_rank_compute_ratio{{{run}}}', lambda g: len(g) == 2, "both ranks' compute ratio scraped")

    # every query of the dashboard, with its run variable set to this run
    for expr in EXPRESSIONS:
        got = query(expr.replace("$run", run_name))
        if expr in DEVICE_ONLY + WAITING_ONLY:  # DCGM's GPUs, a GPU's MFU: none here; a running job has no
            assert got == [], (expr, got)       # pending reason (test_newer_slurm.py sees one): evaluated, empty
        else:
            assert got and all(s["metric"].get("run") == run_name for s in got if "run" in s["metric"]), expr
