"""What a newer SLURM gives a training job, where the local cluster's SLURM has it (26.05 here,
from a Debian sid root; launcher/localcluster/restd.py configures both): elsewhere each test is
skipped saying what its SLURM lacks.

- The expedited requeue (sbatch --requeue=expedite, SlurmctldParameters=enable_expedited_requeue):
  a run whose profile asks for it is preempted and its next attempt starts at once, without the
  requeue_delay (120 s by default) every other requeued job waits as BeginTime; history says so.
- The controller's own metrics (MetricsType=metrics/openmetrics): the real Prometheus scrapes
  slurmctld's /metrics paths beside `lmlaunch metrics serve`, and every query of the dashboard's
  controller panels answers, as does the run's pending reason while its job waits.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import waiting
from preempt_helpers import BASE, SPEC, ends, finish, lm, preempt, starts, submit, wait_step
from prometheus_server import free_port, prometheus
from slurm_helpers import REPO, job_name
from waiting import HANG_S

from launcher.localcluster import cluster
from launcher.localcluster.config import Settings
from launcher.serve.grafana import CONTROLLER_EXPRESSIONS, CONTROLLER_PATHS, WAITING_ONLY, dashboard
from lmcore.errors import UserError
from lmcore.slurm import admin as rehearsal, client as slurm

pytestmark = pytest.mark.both_versions


@pytest.fixture(scope="module")
def newer(slurm_cluster, module_env, tmp_path_factory) -> dict[str, str]:
    """The module's environment, with a profile ``local-expedite`` (the local one asking for the
    expedited requeue); skipped where this cluster's SLURM has neither feature."""
    cfg = slurm.config()
    if "enable_expedited_requeue" not in cfg.get("SlurmctldParameters", "") or "openmetrics" not in cfg.get("MetricsType", ""):
        pytest.skip(f"SLURM {cfg.get('SLURM_VERSION', '?')} has no expedited requeue and no controller metrics "
                    "(SlurmctldParameters, MetricsType): the suite runs these on 26.05")
    profiles = tmp_path_factory.mktemp("profiles")
    (profiles / "local-expedite.yaml").write_text((REPO / "cluster_profiles" / "local.yaml").read_text()
                                                  + "\nexpedited_requeue: true\n")
    return {**module_env, "LMLAUNCH_PROFILES_DIR": str(profiles)}


def test_an_expedited_requeue_starts_the_next_attempt_at_once_and_history_says_so(newer, module_jobs):
    name = job_name("new", "expedite")
    job, run_dir = submit(newer, name, "resources.nodes=1", "--cluster", "local-expedite")
    module_jobs.append(job)
    assert "#SBATCH --requeue=expedite" in next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    assert slurm.show_job(job).get("ExpeditedRequeue") == "Yes"
    wait_step(run_dir, 15, attempt=1)
    r = preempt(newer, name, "requeue")  # no --start-now: the requeue itself makes the job eligible at once
    assert r["requeued"] and not r.get("started_now"), r
    finish(job, run_dir)
    first, second = ends(run_dir)[0], starts(run_dir)[1]
    assert first["reason"] == "preempted" and ends(run_dir)[-1]["reason"] == "completed", ends(run_dir)
    code, out, err = lm(newer, "history", name, "--json")
    assert code == 0, out + err
    attempts = json.loads(out)["attempts"]
    assert "an expedited requeue: eligible again at once" in attempts[0]["detail"], attempts[0]
    # requeued to started: well inside the requeue_delay a plain requeue waits (120 s: BeginTime)
    assert attempts[1]["queue_wait_s"] is not None and attempts[1]["queue_wait_s"] < 60, attempts[1]
    assert second["start_step"] == first["end_step"]


def test_the_controllers_own_metrics_answer_every_query_of_the_dashboards_controller_panels(
        newer, slurm_cluster, module_jobs, tmp_path):
    ports = Settings.from_json(slurm_cluster.settings.read_text()).ports
    # a run whose job waits (held): the queue and its pending reason have something to show
    name = job_name("new", "metrics")
    code, out, err = lm(newer, "submit", SPEC, f"name={name}", *BASE, "resources.nodes=1", "slurm.sbatch.hold=true")
    assert code == 0, out + err
    job = re.search(r"job (\d+)", out).group(1)
    module_jobs.append(job)
    board = tmp_path / "board.json"
    code, out, err = lm(newer, "metrics", "dashboard", "-o", str(board))
    assert code == 0 and "with the controller's panels" in out, out + err
    exprs = [t["expr"] for p in json.loads(board.read_text())["panels"] for t in p["targets"]]
    assert set(CONTROLLER_EXPRESSIONS) <= set(exprs)
    assert not set(CONTROLLER_EXPRESSIONS) & {t["expr"] for p in dashboard()["panels"] for t in p["targets"]}
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--refresh", "1", "--listen",
                              f"127.0.0.1:{port}", "--seconds", "600"], env=newer, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "serve.log", "w"))
    try:
        token_file = Path(newer["LMLAUNCH_HOME"]) / "metrics.token"
        waiting.until(lambda: token_file.is_file() and token_file.read_text().strip(), what="the exporter's token file",
                      progress=waiting.watching(waiting.process_cpu(serve.pid)))
        ctld = f"127.0.0.1:{ports.slurmctld}"
        with prometheus([f"127.0.0.1:{port}"], tmp_path, token_file=token_file,
                        paths=tuple((ctld, path) for path in CONTROLLER_PATHS)) as (server, query):
            def answered(expr: str):
                return waiting.until(lambda: query(expr), what=f"{expr} scraped",
                                     progress=waiting.watching(waiting.process_cpu(server.pid)),
                                     explain=lambda: (tmp_path / "prometheus.log").read_text()[-1500:])

            for expr in CONTROLLER_EXPRESSIONS:
                answered(expr)
            pending = answered('slurm_partition_jobs_pending{partition="low"}')
            assert float(pending[0]["value"][1]) >= 1, pending
            nodes = {s["metric"]["__name__"] for s in answered(CONTROLLER_EXPRESSIONS[2])}
            assert {"slurm_nodes_idle", "slurm_nodes_alloc", "slurm_nodes_down"} <= nodes, nodes
            (reason,) = answered(WAITING_ONLY[0].replace("$run", name))
            assert reason["metric"]["reason"] == "JobHeldUser" and reason["metric"]["run"] == name, reason
    finally:
        serve.terminate()
        serve.wait(timeout=HANG_S)
        slurm.cancel([job])


def test_an_expedited_node_failure_requeue_starts_at_once_off_the_failed_node(newer, module_jobs):
    """The node is kept out (drained, as a failed one is out of service), and the job, requeued by
    SLURM for the node failure, starts again at once on the other node and completes."""
    name = job_name("new", "expedite-nf")
    job, run_dir = submit(newer, name, "resources.nodes=1", "--cluster", "local-expedite")
    module_jobs.append(job)
    wait_step(run_dir, 15, attempt=1)
    r = preempt(newer, name, "node-failure")  # no --start-now
    assert r["requeued"], r
    finish(job, run_dir)
    first, second = ends(run_dir)[0], starts(run_dir)[1]
    assert first["reason"] == "node_failure" and ends(run_dir)[-1]["reason"] == "completed", ends(run_dir)
    assert r["node"] in starts(run_dir)[0]["nodes"] and r["node"] not in second["nodes"], starts(run_dir)
    code, out, err = lm(newer, "history", name, "--json")
    assert code == 0, out + err
    attempts = json.loads(out)["attempts"]
    assert "an expedited requeue" in attempts[0]["detail"] and attempts[1]["queue_wait_s"] < 60, attempts
    # the node back in service for the next test on this worker's cluster (preempt resumed it; wait
    # until its daemon answers): a reservation of both nodes failed after this test otherwise (R50)
    with contextlib.suppress(UserError):
        rehearsal.set_node_state(r["node"], "RESUME")
    waiting.until(lambda: cluster.nodes_ready(), progress=lambda: slurm.run(["sinfo", "-N", "-h"], check=False).stdout,
                  what=f"{r['node']} in service again")
