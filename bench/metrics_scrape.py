"""One Prometheus scrape of `lmlaunch metrics serve` with N registered runs, against `squeue`
itself measured in the same run. Prints JSON with the times and their ratio.

    python bench/metrics_scrape.py [--runs 10000] [--repeat 7]

The N runs get synthetic run directories (heartbeat, ledger, checkpoint; tests/unit/monitor_synth.py)
in a temporary LMLAUNCH_HOME, aged by a minute (ended runs: the run-directory cache serves them),
their job ids real ones from this cluster's accounting (reused round-robin). The exporter is a real
`lmlaunch metrics serve` process on a loopback port; each scrape is an HTTP GET of /metrics, as
Prometheus does. `first_scrape_s` waits for the exporter's first reading of the runs (and fills the caches: the
final-jobs cache, one sacct call); `scrape_s` is the median of later scrapes, answered from the
newest reading; `reading_s` is how long one reading of all the runs takes (the exporter's own
`lmlaunch_exporter_read_duration_seconds`): the most a scrape's figures can lag behind the files.

Goal: **a scrape at 10,000 runs in under 0.5 s** (the median of the later scrapes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))
GOAL_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> tuple[float, bytes]:
    began = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=600) as r:
        body = r.read()
    return time.perf_counter() - began, body


def _make_runs(home: Path, n: int) -> None:
    from monitor_synth import make_run

    from lmcore.slurm import client as slurm

    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-S", "now-7days"], capture_output=True,
                          text=True, env=slurm.slurm_env())
    real_ids = [j for j in acct.stdout.split() if j.isdigit()] or ["1"]
    now = time.time()
    for i in range(n):
        jid = real_ids[i % len(real_ids)]
        make_run(home, f"bench-{i:05d}", job_ids=(jid,), submitted_at=now - 3600, checkpoint_step=40, attempts=[
            {"job_id": jid, "start_step": 0, "end_step": 50, "t0": now - 3500, "t1": now - 3300}])
    t_old = time.time() - 60  # files changed within 2 s are never cached (status_cache.RACY_S)
    for root, dirs, files in os.walk(home):
        for name in files + dirs:
            os.utime(os.path.join(root, name), (t_old, t_old))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    from lmcore.slurm import client as slurm

    home = Path(tempfile.mkdtemp(prefix="lmlaunch-scrape-"))
    server = None
    try:
        _make_runs(home, args.runs)
        env = {**os.environ, "LMLAUNCH_HOME": str(home)}
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "launcher.cli", "metrics", "serve", "--listen",
                                   f"127.0.0.1:{port}", "--no-token"], env=env,  # the scrape alone (no header) stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        while True:  # listening once it printed its line
            line = server.stdout.readline()
            if "serving" in line or not line:
                break
        first, body = _scrape(port)
        series = sum(1 for x in body.decode().splitlines() if x.startswith("lmlaunch_run_step{"))
        scrapes, reads = [], []
        for _ in range(args.repeat):
            took, body = _scrape(port)
            scrapes.append(took)
            reads += [float(x.split()[-1]) for x in body.decode().splitlines()
                      if x.startswith("lmlaunch_exporter_read_duration_seconds ")]
            time.sleep(1.0)  # a later reading each time
        squeue = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            subprocess.run(["squeue", "-h"], env=slurm.slurm_env(), capture_output=True, check=True)
            squeue.append(time.perf_counter() - began)
        med = statistics.median
        print(json.dumps({
            "runs": args.runs, "runs_with_a_step_series": series, "first_scrape_s": round(first, 3),
            "scrape_s": round(med(scrapes), 4), "bytes": len(body),
            "reading_s": round(med(reads), 3) if reads else None,  # how stale a scrape's answer can be, at most
            "squeue_s": round(med(squeue), 4),
            "ratio_scrape_vs_squeue": round(med(scrapes) / med(squeue), 1), "goal_s": GOAL_S,
            "meets_goal": med(scrapes) <= GOAL_S}, indent=2))
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
