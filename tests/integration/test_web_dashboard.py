"""`lmlaunch dashboard` in a real browser: Debian's headless `chromium` loads the page while a 2-node
job trains on the local cluster. The page shows the run in the runs table and its curves' canvases
(the validation loss beside the training loss; an empty chart says why),
refreshes without reloading and shows live data (a later load, once the run went on, shows a later
step), logs nothing to the browser console; a request without the token is refused, a write is refused, and a screenshot is
kept in the test's directory."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

from preempt_helpers import submit, wait_step
from prometheus_server import free_port
from waiting import HANG_S

BROWSER = ("--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0")


def _status(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=HANG_S) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def _load(chromium: str, url: str) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran (about 5 refreshes of virtual time) and the browser
    console's lines."""
    page = subprocess.run([chromium, *BROWSER, "--virtual-time-budget=10000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=HANG_S)
    return page.stdout, [x for x in page.stderr.splitlines() if ":CONSOLE" in x]


def test_the_dashboard_shows_a_training_run_live_in_a_real_browser(slurm_cluster, lm_env, run_name, own_jobs,
                                                                   tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: scripts/setup.sh installs it (as root)"
    job_id, run_dir = submit(lm_env, run_name, "trainer.max_steps=100000", "trainer.val_check_interval=2",
                             "trainer.limit_val_batches=1")
    own_jobs.append(job_id)
    wait_step(run_dir, 3, job_id=job_id)  # validated at step 2 by then
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "launcher.cli", "dashboard", "--listen", f"127.0.0.1:{port}",
                               "--refresh", "0.5", "--seconds", "1800"], env=lm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        url = re.search(r"(http://\S+/\?token=\S+)", server.stdout.readline()).group(1)
        base = f"http://127.0.0.1:{port}"
        assert _status(f"{base}/") == 403 and _status(f"{base}/api/runs?token=wrong") == 403
        assert _status(url, method="POST") == 405
        assert _status(url.replace("/?", "/api/run/no-such-run?")) == 404

        dom, console = _load(chromium, url + f"&run={run_name}")
        assert run_name in dom and "RUNNING" in dom, dom[:3000]
        assert all(f'id="{c}"' in dom for c in ("loss-chart", "speed-chart", "rank-chart", "attempts", "notes"))
        assert "attempt 1 (job " in dom and f"{run_name}: attempt 1, step" in dom
        # the validation loss beside the training loss; an empty chart says why rather than drawing empty axes
        assert 'data-loss-series="training loss,validation loss"' in dom, dom[:3000]
        assert "no evaluator runs alongside this run (eval.alongside in its spec)" in dom, dom[:3000]
        # it refreshed without reloading (the refresh count), and what it shows is live: a later
        # load, once the run has gone on, shows a later step
        assert int(re.search(r"\(refresh (\d+);", dom).group(1)) >= 2, dom[:2000]
        steps = [int(s) for s in re.search(r'data-steps="([0-9,]+)"', dom).group(1).split(",")]
        assert len(steps) >= 2, steps
        wait_step(run_dir, steps[-1] + 4, job_id=job_id)
        later, console_later = _load(chromium, url + f"&run={run_name}")
        later_steps = [int(s) for s in re.search(r'data-steps="([0-9,]+)"', later).group(1).split(",")]
        assert later_steps[-1] > steps[-1], (steps, later_steps)
        assert console == [] and console_later == [], console + console_later  # no script error, nothing logged

        shot = tmp_path / "dashboard.png"
        subprocess.run([chromium, *BROWSER, "--virtual-time-budget=4000", "--window-size=1280,1100", f"--screenshot={shot}",
                        url + f"&run={run_name}"], capture_output=True, timeout=HANG_S)
        assert shot.exists() and shot.stat().st_size > 10_000
        print(f"screenshot of the dashboard: {shot}")
    finally:
        server.terminate()
        server.wait(timeout=HANG_S)
