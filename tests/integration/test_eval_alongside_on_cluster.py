"""Evaluation alongside training on the real local cluster (eval.alongside): one trainer node and one
evaluator node are one SLURM heterogeneous job (``J+0``, ``J+1`` in sacct). It is preempted while the
evaluator scores a checkpoint, requeued, and completes; every checkpoint is scored exactly once (the
one being scored at the preemption again after the requeue), retention keeping what is not scored
yet (keep_last: 1); the scores equal those of ``lm-eval run`` on the exported checkpoint of the same
step; history, status --json, the exporter (scraped by the real Prometheus) and the web dashboard (in
headless Chromium) show them. An evaluator killed by SIGKILL mid-checkpoint never stops the
training: the job completes, and status and ``logs --errors`` say what happened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import waiting
from preempt_helpers import BASE, finish, held_at, lm, log_tail, preempt, run_progress, wait_attempt_running
from prometheus_server import free_port, prometheus
from slurm_helpers import PACE_S, REPO, faults, pace, wait_terminal
from waiting import HANG_S

from launcher.planning.resolve import eval_interpreter
from launcher.spec.profiles import load_profile
from lmcore.run import eval_alongside as ev

SPEC = REPO / "jobs" / "tiny-cpu-eval.yaml"
TASKS = ("lmlaunch_pydoc_choice", "lmlaunch_pydoc_perplexity")
LIMIT = 8  # examples per task: a checkpoint scores in seconds
EVAL_BASE = (*[b for b in BASE if not b.startswith(("checkpoint.", "trainer.max_steps"))],
             "trainer.global_batch_size=8", "checkpoint.keep_last=1", f"eval.alongside.limit={LIMIT}",
             "eval.alongside.finish_wait_s=300")


def submit_eval(environ: dict[str, str], name: str, *overrides: str, holds: tuple[dict, ...] = ()) -> tuple[str, Path]:
    with faults(pace(PACE_S), *holds):
        code, out, err = lm(environ, "submit", SPEC, f"name={name}", *EVAL_BASE, *overrides)
    assert code == 0, out + err
    return re.search(r"job (\d+)", out).group(1), Path(environ["LMLAUNCH_RUNS_ROOT"]) / name


def scoring(run_dir: Path, job_id: str) -> dict:
    """Wait until the evaluator scores a checkpoint; its state."""
    def now() -> dict | None:
        st = ev.read_state(run_dir) or {}
        return st if st.get("state") == "scoring" else None

    return waiting.until(now, progress=run_progress(run_dir, job_id), poll=0.1, what="the evaluator scoring",
                         explain=lambda: f"{ev.read_state(run_dir)}\n{log_tail(run_dir)}")


def score_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in ev.scores_path(run_dir).read_text().splitlines()]


def test_every_checkpoint_is_scored_once_through_a_preemption_and_equals_lm_eval(
        slurm_cluster, lm_env, run_name, own_jobs, tmp_path):
    # training held after step 41 until the preemption: it cannot end first, and the evaluator scores
    # step 40's checkpoint (at the latest) while it is held; 3 periodic checkpoints and the stop's
    job_id, run_dir = submit_eval(lm_env, run_name, "trainer.max_steps=60", "checkpoint.every_n_steps=20",
                                  holds=(held_at(41),))
    own_jobs.append(job_id)
    at = scoring(run_dir, job_id)
    assert preempt(lm_env, run_name, "requeue", "--start-now")["requeued"]
    wait_attempt_running(run_dir, 2, job_id)
    finish(job_id, run_dir)

    # one heterogeneous job: both components in accounting, under the job's id
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State"], capture_output=True,
                          text=True, timeout=HANG_S).stdout.split()
    assert {row.split("|")[0] for row in acct} == {f"{job_id}+0", f"{job_id}+1"}, acct
    lines = score_lines(run_dir)
    steps = [rec["step"] for rec in lines]
    assert len(steps) == len(set(steps)), f"a checkpoint scored twice: {steps}"
    # every checkpoint the run wrote: the periodic ones and the stop's at the preemption (none skipped)
    stops = {int(e["stop_step"]) for e in _ledger(run_dir) if e.get("event") == "end" and e.get("stop_step")
             and f"checkpoint step-{e['stop_step']} complete" in str(e.get("detail"))}
    assert set(steps) == set(range(20, 61, 20)) | stops, (steps, stops)
    assert at["step"] in steps and {rec["job_id"] for rec in lines} == {job_id}
    assert (ev.read_state(run_dir) or {}).get("state") == "done"
    assert all({s["task"] for s in rec["scores"]} == set(TASKS) for rec in lines)

    # the figures are lm-eval's own: `lm-eval run` on the export of the last step gives the same
    exported = tmp_path / "export"
    code, out, err = lm(lm_env, "export", "--to", "hf", "--step", "60", run_name, str(exported))
    assert code == 0, out + err
    direct = _lm_eval_run(exported, run_dir / ev.TASKS_DIR, tmp_path / "lm_eval_out")
    ours = {(s["task"], s["metric"]): s["value"] for s in next(r for r in lines if r["step"] == 60)["scores"]}
    assert ours == direct, (ours, direct)

    code, out, _ = lm(lm_env, "history", run_name, "--json")
    hist = json.loads(out)
    assert len(hist["attempts"]) == 2 and sorted({r["step"] for r in hist["eval"]}) == sorted(steps)
    code, out, _ = lm(lm_env, "status", run_name, "--json")
    row = json.loads(out)["runs"][0] if "runs" in json.loads(out) else json.loads(out)[0]
    assert row["eval"]["latest"]["step"] == 60 and row["eval"]["scored"] == len(steps) and not row["eval"]["trouble"]
    _exporter_and_dashboard(lm_env, run_name, tmp_path, ours)


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines() if x.strip()]


def _lm_eval_run(model: Path, tasks: Path, out: Path) -> dict:
    """`lm-eval run` on its own, in the evaluator's environment (the local profile's eval_python)."""
    env = {**os.environ, **{k: "1" for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}}
    python = eval_interpreter(load_profile("local"), sys.executable)
    proc = subprocess.run([python, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                           f"pretrained={model},dtype=float32", "--tasks", ",".join(TASKS), "--include_path", str(tasks),
                           "--batch_size", "8", "--limit", str(LIMIT), "--device", "cpu", "--output_path", str(out)],
                          capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    return {(task, key.split(",")[0]): value for task, metrics in results.items() for key, value in metrics.items()
            if key.endswith(",none") and "_stderr" not in key and isinstance(value, (int, float))}


def _exporter_and_dashboard(lm_env, run_name, tmp_path, ours) -> None:
    """The exporter's lmlaunch_run_eval as Prometheus scraped it, and the dashboard's score chart."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--refresh", "1", "--listen",
                              f"127.0.0.1:{port}", "--seconds", "600"], env=lm_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        token_file = Path(lm_env["LMLAUNCH_HOME"]) / "metrics.token"
        waiting.until(lambda: token_file.is_file() and token_file.read_text().strip(), what="the exporter's token",
                      progress=waiting.watching(waiting.process_cpu(serve.pid)))
        with prometheus([f"127.0.0.1:{port}"], tmp_path, token_file=token_file) as (server, query):
            expr = f'lmlaunch_run_eval{{run="{run_name}", task="lmlaunch_pydoc_choice", metric="acc"}}'
            got = waiting.until(lambda: query(expr) or None, what="the score scraped",
                                progress=waiting.watching(waiting.process_cpu(server.pid)))
            assert float(got[0]["value"][1]) == ours[("lmlaunch_pydoc_choice", "acc")]
    finally:
        serve.terminate()
        serve.wait(timeout=HANG_S)
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: scripts/setup.sh installs it (as root)"
    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "launcher.cli", "dashboard", "--listen", f"127.0.0.1:{port}",
                              "--seconds", "600"], env=lm_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    try:
        url = re.search(r"(http://\S+/\?token=\S+)", board.stdout.readline()).group(1) + f"&run={run_name}"
        page = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=6000",
                               "--dump-dom", url], capture_output=True, text=True, timeout=HANG_S)
        drawn = re.search(r'data-eval-steps="([0-9,]+)"', page.stdout)
        assert drawn and "60" in drawn.group(1).split(",") and 'id="eval-chart"' in page.stdout, page.stdout[:2000]
    finally:
        board.terminate()
        board.wait(timeout=HANG_S)


def test_an_evaluator_killed_mid_checkpoint_never_stops_the_training(slurm_cluster, lm_env, run_name, own_jobs):
    # first, one the cluster cannot hold: the controller refuses the heterogeneous job, nothing is queued
    code, out, err = lm(lm_env, "submit", SPEC, f"name={run_name}", *EVAL_BASE, "eval.alongside.cpus_per_task=64")
    assert code == 5 and "eval.alongside: SLURM refuses the heterogeneous job" in err, out + err
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name).exists()
    job_id, run_dir = submit_eval(lm_env, run_name, "trainer.max_steps=60", "checkpoint.every_n_steps=20",
                                  "eval.alongside.finish_wait_s=30")
    own_jobs.append(job_id)
    at = scoring(run_dir, job_id)
    os.kill(int(at["pid"]), signal.SIGKILL)  # the node is this machine: its python, srun's task
    finish(job_id, run_dir)
    assert (ev.read_exit(run_dir) or ("", 0, 0))[1] == 128 + signal.SIGKILL
    code, out, _ = lm(lm_env, "status", run_name)
    assert f"evaluator killed (SIGKILL: the OOM killer, or kill -9) while scoring step {at['step']}" in out, out
    assert "training goes on" in out
    code, out, _ = lm(lm_env, "logs", run_name, "--errors")
    assert "the evaluator's srun exited 137" in out, out
    ends = [e for e in _ledger(run_dir) if e.get("event") == "end"]
    assert ends[-1]["reason"] == "completed" and ends[-1]["end_step"] == 60

    # `lmlaunch eval RUN` scores what is left as an ordinary job (retention kept nothing for a dead
    # evaluator: step 60 is what remains), once; asked again, there is nothing left to score
    before = [rec["step"] for rec in score_lines(run_dir)] if ev.scores_path(run_dir).exists() else []
    code, out, err = lm(lm_env, "eval", run_name)
    assert code == 0, out + err
    eval_job = re.search(r"submitted job (\d+)", out).group(1)
    own_jobs.append(eval_job)
    assert wait_terminal(eval_job, watch=[run_dir]) == "COMPLETED", log_tail(run_dir)
    steps = [rec["step"] for rec in score_lines(run_dir)]
    assert steps == [*before, 60] and at["step"] not in before, (before, steps)
    code, out, _ = lm(lm_env, "eval", run_name)
    assert code == 0 and "scored already" in out, out
