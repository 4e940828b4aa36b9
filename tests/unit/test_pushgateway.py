"""A job pushes its training metrics to a real Prometheus Pushgateway (Debian's
`prometheus-pushgateway`, started here on a loopback port): rank 0's pusher on its own, and a
local run whose spec names the gateway; an unreachable gateway is said once and costs nothing."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import time
import urllib.request

import pytest
import waiting
from prometheus_client.parser import text_string_to_metric_families
from prometheus_server import free_port
from waiting import HANG_S

from launcher.cli import main
from launcher.context import Context


@pytest.fixture
def gateway(tmp_path):
    binary = shutil.which("prometheus-pushgateway")
    assert binary, "Debian's prometheus-pushgateway is missing: scripts/setup.sh installs it (as root)"
    port = free_port()
    proc = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "pushgateway.log", "w"))
    url = f"http://127.0.0.1:{port}"
    waiting.until(lambda: _read(url) is not None or None, what="the pushgateway answering",
                  progress=waiting.process_cpu(proc.pid), explain=lambda: (tmp_path / "pushgateway.log").read_text())
    yield url
    proc.terminate()
    proc.wait(timeout=HANG_S)


def _read(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=HANG_S) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, s.labels.get("run")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("lmlaunch_job_") and s.labels.get("job") == "lmlaunch"}


def test_rank_0_pushes_every_nth_logging_step_and_the_last(gateway):
    from lmtrain.observe.pushgateway import Pusher

    pusher = Pusher(gateway, run="r1", attempt=2, every_n_steps=10)
    for step in (5, 10, 15, 20, 23):
        pusher.step_metrics({"step": step, "loss": 3.0 - step / 100, "tokens_per_s": 1000.0 + step, "mfu": None},
                            max_steps=23)
    pusher.close()
    got = _read(gateway)
    assert got[("lmlaunch_job_step", "r1")] == 23 and got[("lmlaunch_job_max_steps", "r1")] == 23
    assert got[("lmlaunch_job_train_loss", "r1")] == pytest.approx(2.77)
    assert got[("lmlaunch_job_attempt", "r1")] == 2 and ("lmlaunch_job_mfu_ratio", "r1") not in got
    assert got[("lmlaunch_job_last_push_timestamp_seconds", "r1")] > time.time() - HANG_S
    assert 1 <= pusher.pushed <= 3  # steps 10, 20 and 23 queued; only the newest waits


def test_an_unreachable_gateway_is_said_once_and_never_raises(caplog):
    from lmtrain.observe.pushgateway import Pusher

    pusher = Pusher(f"http://127.0.0.1:{free_port()}", run="r2", attempt=1, every_n_steps=1)
    for step in range(1, 4):
        pusher.step_metrics({"step": step, "loss": 1.0, "tokens_per_s": None, "mfu": None}, max_steps=3)
        waiting.until(lambda: pusher._latest is None or None, what="the push tried",
                      progress=waiting.watching(lambda: pusher.pushed))
    pusher.close()
    assert pusher.pushed == 0 and caplog.text.count("the push failed") == 1


@pytest.mark.slow
def test_a_local_run_whose_spec_names_a_gateway_pushes_its_last_step(gateway, repo, runs_root):
    out = io.StringIO()
    ctx = Context(stdout=out, stderr=out, environ={**os.environ, "LMLAUNCH_RUNS_ROOT": str(runs_root)})
    code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--devices", "1", "--max-steps", "12",
                 "name=pushed", f"logging.pushgateway.url={gateway}", "logging.pushgateway.every_n_steps=1",
                 "trainer.val_check_interval=null", "model.config.n_embd=32", "model.config.n_head=2"], ctx)
    assert code == 0, out.getvalue()[-3000:]
    got = _read(gateway)
    assert got[("lmlaunch_job_step", "pushed-local")] == 12 and got[("lmlaunch_job_train_loss", "pushed-local")] > 0
    assert got[("lmlaunch_job_attempt", "pushed-local")] == 1  # `run --local` names it <name>-local
