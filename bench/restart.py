"""Restart to first step on the real local SLURM cluster, decomposed, against the bare imports
measured in the same run.

One run of jobs/tiny-cpu.yaml (2 nodes x 1 task, gloo; ``--spec`` for another) is preempted
``--preemptions`` times (`lmlaunch preempt --mode requeue --start-now`: a real partition
preemption, the requeued job started at once). Every attempt writes a ``startup`` record into
its ledger (lmtrain.observe.startup); for every restarted attempt this prints its phases and

- ``process_to_first_step_s``: the task process's start -> its first optimizer step;
- ``requeue_gap_s``: the previous attempt's end line -> this attempt's process start (SLURM:
  job end, requeue, scheduling, prolog, batch script, srun);
- the goal: ``process_to_first_step_s <= bare_import_s + 2 s + checkpoint_read_s``, with
  ``bare_import_s`` the median wall time of ``python -c "import torch, lightning, transformers"``
  (3 runs, before the job) and ``checkpoint_read_s`` the checkpoint's bytes over the read speed
  of this filesystem measured with the page cache dropped for the file (posix_fadvise).

Ends with one JSON object: the figures, the baselines and ``meets_goal``.

    python bench/restart.py [--preemptions 2] [--spec jobs/tiny-cpu.yaml] [--keep]

The cluster must be up (`lmlaunch cluster up`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preemption import REPO, cli, ledger, poll, steps

from lmcore.slurm import admin as rehearsal, client as slurm

GOAL_SLACK_S = 2.0


def bare_import_s(runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, lightning, transformers"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_speed_bps(directory: Path, size: int = 256 << 20) -> float:
    """Bytes per second reading a file of ``size`` bytes from ``directory`` with its pages
    dropped from the page cache first (what a requeued job on another node sees)."""
    path = directory / "read-speed.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.read(fd, 8 << 20):
                pass
            return size / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        path.unlink()


def restarted(run_dir: Path, attempt: int, bare: float, read_bps: float) -> dict:
    rec = next(e for e in ledger(run_dir, "startup") if e["attempt"] == attempt)
    prev_end = next(e for e in ledger(run_dir, "end") if e["attempt"] == attempt - 1)
    phases = rec["phases"]
    order = list(phases)
    spent = {p: round(phases[p] - (phases[order[i - 1]] if i else 0.0), 3) for i, p in enumerate(order)}
    total = phases["first_step"]
    ckpt_read = (rec.get("checkpoint_bytes") or 0) / read_bps
    limit = bare + GOAL_SLACK_S + ckpt_read
    return {
        "bench": "restart",
        "attempt": attempt,
        "requeue_gap_s": round(rec["process_start"] - prev_end["time"], 3),
        "phases_s": spent,
        "process_to_first_step_s": round(total, 3),
        "beyond_imports_s": round(total - spent.get("imports", 0.0), 3),
        "checkpoint_bytes": rec.get("checkpoint_bytes"),
        "checkpoint_read_s": round(ckpt_read, 4),
        "goal_s": round(limit, 3),
        "meets_goal": total <= limit,
    }


def run(spec: Path, preemptions: int, keep: bool) -> int:
    root = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-restart-"))
    environ = dict(os.environ, LMLAUNCH_HOME=str(root / "home"), LMLAUNCH_RUNS_ROOT=str(root / "runs"))
    bare = bare_import_s()
    read_bps = read_speed_bps(root)
    name = f"bench-restart-{int(time.time())}"
    max_steps = 40 * (preemptions + 1)
    out = cli(environ, "submit", spec, f"name={name}", f"trainer.max_steps={max_steps}", "optim.warmup_steps=3",
              "trainer.val_check_interval=null", "trainer.log_every_n_steps=1", "logging.heartbeat_every_n_steps=1",
              "checkpoint.every_n_steps=20")
    job = re.search(r"job (\d+)", out).group(1)
    run_dir = root / "runs" / name
    state = "?"
    try:
        for attempt in range(1, preemptions + 1):
            poll(f"10 steps of attempt {attempt}", lambda a=attempt: len(steps(run_dir, a)) >= 10, job_id=job)
            cli(environ, "preempt", name, "--mode", "requeue", "--start-now")
            poll(f"the first step of attempt {attempt + 1}",
                 lambda a=attempt: any(e["attempt"] == a + 1 for e in ledger(run_dir, "startup")), job_id=job)
        state = rehearsal.wait_for(job, {"completed", "failed", "cancelled", "timeout"}, timeout=600, poll=1.0,
                                   start_requeued=True)
    finally:
        if slurm.is_active(slurm.job_state(job)):
            slurm.cancel([job])
    records = [restarted(run_dir, a, bare, read_bps) for a in range(2, preemptions + 2)]
    first = next(e for e in ledger(run_dir, "startup") if e["attempt"] == 1)
    for r in records:
        print(json.dumps(r))
    print(json.dumps({
        "bench": "restart_summary",
        "final_state": state,
        "spec": str(spec.relative_to(REPO) if spec.is_relative_to(REPO) else spec),
        "baseline_bare_import_s": round(bare, 3),
        "baseline_read_speed_gb_s": round(read_bps / 1e9, 3),
        "first_attempt_process_to_first_step_s": first["phases"].get("first_step"),
        "restart_process_to_first_step_s": [r["process_to_first_step_s"] for r in records],
        "restart_beyond_imports_s": [r["beyond_imports_s"] for r in records],
        "requeue_gap_s": [r["requeue_gap_s"] for r in records],
        "ratio_to_bare_import": [round(r["process_to_first_step_s"] / bare, 3) for r in records],
        "meets_goal": all(r["meets_goal"] for r in records) and state == "COMPLETED",
    }))
    if keep:
        print(f"run dir kept: {run_dir}  (lmlaunch history {run_dir} --timing)", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if state == "COMPLETED" else 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=REPO / "jobs" / "tiny-cpu.yaml")
    p.add_argument("--preemptions", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    sys.exit(run(a.spec.resolve(), a.preemptions, a.keep))
