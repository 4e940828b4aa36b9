"""Load: 970 runs in the registry, then 30 more submitted back to back through the CLI (held in
SLURM: the PATH wrapper adds `--hold` to the real sbatch, so the 2-core machine never runs them),
each submission beside the ~1000 others calling SLURM the same two times; then `lmlaunch status`
over the 1000 calls SLURM a bounded number of times per refresh and rereads no unchanged run.
SLURM calls are counted by wrappers on PATH that log each invocation. (The status latency over
1000 runs is measured by bench/status_latency.py --runs 1000.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from slurm_helpers import REPO

from lmcore.slurm import client as slurm

sys.path.insert(0, str(REPO / "tests" / "unit"))
from monitor_synth import make_run
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")
SUBMITTED = 30
SYNTHETIC = 970
SLURM_CLIENTS = ("squeue", "sacct", "scontrol", "sinfo", "sbatch", "scancel")


def _counting_path(tmp_path: Path) -> tuple[str, Path]:
    """A PATH whose SLURM clients log their name and arguments, then exec the real one."""
    bin_dir, log = tmp_path / "counting-bin", tmp_path / "slurm-calls.log"
    bin_dir.mkdir()
    for name in SLURM_CLIENTS:
        real = shutil.which(name)
        # sbatch --hold: queued for real, never started (slurm 22.05 has no SBATCH_HOLD variable)
        extra = " --hold" if name == "sbatch" else ""
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}"{extra} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}", log


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _register_old_runs(home: Path, run_name: str, count: int = SYNTHETIC) -> None:
    """``count`` older runs next to the submitted ones, with real job ids from this cluster's accounting
    (reused round-robin) so squeue and sacct do real work."""
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-S", "now-7days"], capture_output=True,
                          text=True, env=slurm.slurm_env())
    real_ids = [j for j in acct.stdout.split() if j.isdigit()] or ["1"]
    now = time.time()
    for i in range(count):
        jid = real_ids[i % len(real_ids)]
        make_run(home, f"{run_name}-old-{i:04d}", job_ids=(jid,), submitted_at=now - 3600, checkpoint_step=40,
                 attempts=[{"job_id": jid, "start_step": 0, "end_step": 50, "t0": now - 3000, "t1": now - 2000,
                            "reason": "completed"}])
    assert len(list((home / "registry").glob("*.json"))) == count


def _age(tree: Path, seconds: float = 60.0) -> None:
    t = time.time() - seconds
    for root, dirs, files in os.walk(tree):
        for n in files + dirs:
            os.utime(os.path.join(root, n), (t, t), follow_symlinks=False)


def _status_refreshes(lm_env: dict, path: str, log: Path, n: int = 5) -> tuple[list[float], list[list[str]]]:
    lmlaunch = str(Path(sys.executable).parent / "lmlaunch")
    env = {**lm_env, "PATH": path, "COLUMNS": "160"}
    first = subprocess.run([lmlaunch, "status", "--all"], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert first.returncode == 0, first.stderr
    times, per_refresh = [], []
    for _ in range(n):
        before = len(_calls(log))
        t = time.perf_counter()
        p = subprocess.run([lmlaunch, "status", "--all"], env=env, capture_output=True, text=True, timeout=HANG_S)
        times.append(time.perf_counter() - t)
        assert p.returncode == 0, p.stderr
        per_refresh.append(_calls(log)[before:])
    return times, per_refresh


def test_submissions_beside_1000_runs_and_their_status_call_slurm_a_bounded_number_of_times_and_reread_no_unchanged_run(
    slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path, monkeypatch
):
    path, log = _counting_path(tmp_path)
    monkeypatch.setenv("PATH", path)
    ids: list[str] = []
    home = Path(lm_env["LMLAUNCH_HOME"])
    _register_old_runs(home, run_name)
    before = len(_calls(log))  # the registration's own sacct
    try:
        t0 = time.monotonic()
        for i in range(SUBMITTED):
            r = cli("submit", SPEC, f"name={run_name}-{i:03d}", "trainer.max_steps=5", "optim.warmup_steps=1")
            assert r.code == 0, r.err
            ids.append(re.search(r"job (\d+)", r.out).group(1))
            own_jobs.append(ids[-1])
        submit_s = time.monotonic() - t0
        per_submit = _calls(log)[before:]
        print(f"\n{SUBMITTED} submissions in {submit_s:.1f} s ({SUBMITTED / submit_s:.1f}/s), "
              f"{len(per_submit)} SLURM calls")
        # every submission: one controller ping (scontrol) and one sbatch, nothing per existing run; and one
        # sinfo for them all (the partition's facts the shape check keeps: launcher/submit/shape_check.py)
        assert sum(c.startswith("sbatch ") for c in per_submit) == SUBMITTED
        sinfo = sum(c.startswith("sinfo ") for c in per_submit)
        assert sinfo == 1 and len(per_submit) == 2 * SUBMITTED + sinfo, per_submit[:6]
        held = slurm.squeue(ids)
        assert len(held) == SUBMITTED and {j.state for j in held} == {"PENDING"}
        assert len(set(ids)) == SUBMITTED
        assert len(list((home / "registry").glob("*.json"))) == SUBMITTED + SYNTHETIC
        for tree in (home, Path(lm_env["LMLAUNCH_RUNS_ROOT"])):  # nothing changed in the last minute
            _age(tree)
        times, per_refresh = _status_refreshes(lm_env, path, log)
        print(f"status over {SUBMITTED + SYNTHETIC} runs: median {statistics.median(times):.3f} s "
              f"(latency: bench/status_latency.py --runs 1000); "
              f"SLURM calls per refresh: {[[c.split()[0] for c in calls] for calls in per_refresh]}")
        # bounded: one squeue for all jobs (+ at most one sacct for jobs the controller forgot)
        for calls in per_refresh:
            assert sum(c.startswith("squeue ") for c in calls) == 1, calls
            assert sum(c.startswith("sacct ") for c in calls) <= 1 and len(calls) <= 2, calls
        # bounded reading too: every run directory and registry entry is served from the caches
        # (one stat per watched file), which later refreshes never needed to rewrite
        caches = home / "cache"
        run_files = json.loads((caches / "run-files.json").read_text())["runs"]
        index = json.loads((caches / "registry-index.json").read_text())["entries"]
        assert len(run_files) == len(index) == SUBMITTED + SYNTHETIC
        written = {f: (caches / f).stat().st_mtime_ns for f in ("run-files.json", "registry-index.json")}
        _status_refreshes(lm_env, path, log, n=2)
        assert written == {f: (caches / f).stat().st_mtime_ns for f in written}
    finally:
        if ids:
            slurm.cancel(ids)
