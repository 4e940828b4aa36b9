"""`lmlaunch status` cold start (a new process each time) with 200 registered runs, against
`squeue` itself measured in the same run. Prints JSON with the times and their ratio.

    python bench/status_latency.py [--runs 200] [--repeat 7] [--recent N] [--over-ssh]

``--recent N``: only N runs were submitted in the last day, the others 2-30 days ago (most
finished: what plain `status` skips before reading anything, its final-jobs cache knowing them).

The 200 runs get synthetic run directories (heartbeat, ledger, checkpoint) in a temporary
LMLAUNCH_HOME; their job ids are real ones from this cluster's accounting (reused round-robin),
so squeue and sacct do real work. The first status call also asks sacct about the jobs the
controller has forgotten and caches their final states; later calls need squeue only — both
are reported. The run directories are aged by a minute (ended runs); `status_uncached_s` drops
the run-directory and registry caches before each call (every file read again), the baseline
for `status_table_s` (unchanged directories served from launcher/monitor/status_cache.py).

``--over-ssh`` (root): also from a workstation, `lmlaunch --remote P status` through a real sshd on
a loopback port (tests/integration/sshd_helpers.py: the cluster account, key login) over an open
master connection, against plain `status` on the same runs in the same run: `remote_plain_s`,
`remote_overhead_s` and `ssh_round_trip_s` (`true` over the master); then again while `lmlaunch
metrics serve` runs on the login node and answers the forwarded command (launcher.remote.warm):
`remote_warm_plain_s`, `remote_warm_overhead_s` (goal: within 0.3 s of the login node's own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tests"))  # waiting.py, which sshd_helpers uses


def _time(cmd: list[str], env: dict[str, str], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        out.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--recent", type=int, default=None,
                    help="runs submitted in the last day; the others were submitted 2-30 days ago (default: all recent)")
    ap.add_argument("--over-ssh", action="store_true", help="also status from a workstation over ssh (a loopback sshd)")
    args = ap.parse_args()

    from monitor_synth import make_run

    from lmcore.slurm import client as slurm

    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-S", "now-7days"], capture_output=True,
                          text=True, env=slurm.slurm_env())
    real_ids = [j for j in acct.stdout.split() if j.isdigit()] or ["1"]
    home = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-"))
    try:
        now = time.time()
        recent = args.runs if args.recent is None else args.recent
        for i in range(args.runs):
            jid = real_ids[i % len(real_ids)]
            submitted = now - 60 if i >= args.runs - recent else now - 86400 * (2 + i % 29)
            make_run(home, f"bench-{i:03d}", job_ids=(jid,), submitted_at=submitted, checkpoint_step=40, attempts=[
                {"job_id": jid, "start_step": 0, "end_step": 50, "t0": submitted + 60, "t1": submitted + 300}])
        env = {**os.environ, "LMLAUNCH_HOME": str(home), "COLUMNS": "160"}
        lmlaunch = shutil.which("lmlaunch", path=str(Path(sys.executable).parent)) or "lmlaunch"
        squeue = _time(["squeue", "-h"], {**env, **slurm.slurm_env()}, args.repeat)
        # runs that ended a while ago (files changed within 2 s are never cached: status_cache.RACY_S)
        t_old = time.time() - 60
        for root, dirs, files in os.walk(home):
            for n in files + dirs:
                os.utime(os.path.join(root, n), (t_old, t_old))
        first = _time([lmlaunch, "status", "--all"], env, 1)  # fills the final-jobs cache (one sacct call)
        uncached = []
        for _ in range(args.repeat):  # the run-directory and registry caches dropped before each call
            for f in ("cache/run-files.json", "cache/registry-index.json"):
                (home / f).unlink(missing_ok=True)
            uncached += _time([lmlaunch, "status", "--all"], env, 1)
        _time([lmlaunch, "status", "--all"], env, 1)  # fills them again
        table = _time([lmlaunch, "status", "--all"], env, args.repeat)
        plain = _time([lmlaunch, "status"], env, args.repeat)  # active and recent runs only
        calls = json.loads(subprocess.run([lmlaunch, "status", "--all", "--json"], env=env, capture_output=True,
                                          text=True).stdout)["slurm"]["calls"]
        js = _time([lmlaunch, "status", "--all", "--json"], env, args.repeat)
        python = _time([sys.executable, "-c", "pass"], env, args.repeat)
        med = statistics.median
        remote = _over_ssh(home, env, lmlaunch, args.repeat) if args.over_ssh else {}
        result = {
            "runs": args.runs,
            "distinct_job_ids": len(set(real_ids[: args.runs])),
            "squeue_s": round(med(squeue), 4),
            "python_startup_s": round(med(python), 4),
            "status_first_call_s": round(first[0], 4),
            "status_uncached_s": round(med(uncached), 4),
            "recent_runs": recent,
            "status_plain_s": round(med(plain), 4),
            "status_table_s": round(med(table), 4),
            "slurm_calls_per_refresh": calls,
            "ratio_status_cached_vs_uncached": round(med(table) / med(uncached), 2),
            "status_json_s": round(med(js), 4),
            "ratio_status_table_vs_squeue": round(med(table) / med(squeue), 1),
            "ratio_status_json_vs_squeue": round(med(js) / med(squeue), 1),
            "goal_plain_s": 0.25,
            "goal_all_s": 1.0 if args.runs >= 10_000 else 0.25,
            "meets_goal": med(plain) <= 0.25 and med(table) <= (1.0 if args.runs >= 10_000 else 0.25),
            **remote,
        }
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def _warm_process(lmlaunch: str, env: dict[str, str], home: Path):
    """`lmlaunch metrics serve` on the "login node" (this machine, the runs' home) while the block runs."""
    import socket

    from launcher.remote import warm

    with socket.socket() as probe:  # a free loopback port for its scrapes (unused here)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([lmlaunch, "metrics", "serve", "--listen", f"127.0.0.1:{port}", "--no-token"],
                            env={**env, "LMLAUNCH_HOME": str(home)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        sock = warm.socket_path({"LMLAUNCH_HOME": str(home)})
        deadline = time.monotonic() + 60
        while not sock.is_socket():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"lmlaunch metrics serve did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _over_ssh(home: Path, env: dict[str, str], lmlaunch: str, repeat: int) -> dict[str, object]:
    """Plain status from a workstation: the same runs, read by the login node's lmlaunch."""
    import sshd_helpers

    where = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-ssh-"))
    node = sshd_helpers.start(where)
    control = where / "cm-%C"
    try:
        ws = where / "workstation"
        (ws / "profiles").mkdir(parents=True)
        passed = {k: env[k] for k in ("SLURM_CONF", "LMLAUNCH_CLUSTER_DIR") if k in env} | {"LMLAUNCH_HOME": str(home)}
        (ws / "profiles" / "viassh.yaml").write_text(sshd_helpers.profile_text(REPO, node, control, passed))
        ssh = ["ssh", "-F", str(node.config), "-o", f"ControlPath={control}"]
        subprocess.run([*ssh[:1], "-fNM", *ssh[1:], "-o", "ControlPersist=yes", "cluster-login"], check=True,
                       stdin=subprocess.DEVNULL)
        ws_env = {**os.environ, "LMLAUNCH_HOME": str(ws), "COLUMNS": "160"}
        trip = _time([*ssh, "-o", "BatchMode=yes", "cluster-login", "true"], ws_env, repeat)
        _time([lmlaunch, "--remote", "viassh", "status"], ws_env, 1)  # the login node's caches as warm as here
        local = _time([lmlaunch, "status"], env, repeat)
        over = _time([lmlaunch, "--remote", "viassh", "status"], ws_env, repeat)
        with _warm_process(lmlaunch, env, home):  # `metrics serve` on the login node answers (launcher.remote.warm)
            _time([lmlaunch, "--remote", "viassh", "status"], ws_env, 1)
            warm_over = _time([lmlaunch, "--remote", "viassh", "status"], ws_env, repeat)
            local_again = _time([lmlaunch, "status"], env, repeat)
        med = statistics.median
        base = min(med(local), med(local_again))
        return {"remote_plain_s": round(med(over), 4), "local_plain_s_same_round": round(med(local), 4),
                "remote_overhead_s": round(med(over) - med(local), 4), "ssh_round_trip_s": round(med(trip), 4),
                "ratio_remote_vs_local": round(med(over) / med(local), 2),
                "remote_warm_plain_s": round(med(warm_over), 4), "local_plain_s_warm_round": round(med(local_again), 4),
                "remote_warm_overhead_s": round(med(warm_over) - base, 4), "goal_remote_overhead_s": 0.3,
                "meets_remote_goal": med(warm_over) - base <= 0.3}
    finally:
        subprocess.run(["ssh", "-F", str(node.config), "-O", "exit", "-o", f"ControlPath={control}", "cluster-login"],
                       capture_output=True)
        node.stop()
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
