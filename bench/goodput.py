"""Goodput through real preemptions on the local SLURM cluster.

One run of jobs/tiny-cpu.yaml (2 nodes x 1 task, gloo) trains for ``--minutes`` of wall time and
is preempted every ``--every`` minutes by a real partition preemption (`lmlaunch preempt --mode
requeue --start-now`: an exclusive job on the high-priority partition; the requeued job is
started at once, SLURM's ~2 min BeginTime after a requeue being cluster policy, not lmlaunch
cost). The run's ``trainer.max_steps`` is set from the step time measured in a short probe run
before it, so that it ends by itself after about ``--minutes``.

From the run's own records (`lmlaunch history --json`: the ledger, the heartbeat and one
``sacct -D``): goodput = training time / allocated time, summed over the attempts (training
time: an attempt's first to last step line; allocated: SLURM's start to end of the attempt);
per preemption the work lost (steps the next attempt had to redo; goal <= 1) and the restart
(the previous attempt's end line -> the next one's first step, with the startup phases of its
ledger record). Goal: **goodput >= 0.90**.

Ends with one JSON object: the figures, the per-attempt table and ``meets_goal``.

    python bench/goodput.py [--minutes 20] [--every 4]

The cluster must be up (`lmlaunch cluster up`) and otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from preemption import SPEC, cli, ledger, poll, steps

from lmcore.slurm import admin as rehearsal, client as slurm

GOAL = 0.90
OVERRIDES = ("optim.warmup_steps=3", "trainer.val_check_interval=null", "trainer.log_every_n_steps=10",
             "logging.heartbeat_every_n_steps=10", "resources.time=01:00:00")


def probe_step_s(environ: dict[str, str], root: Path) -> float:
    """The steady step time of the same job on the same nodes (a short run of its own)."""
    name = f"bench-goodput-probe-{int(time.time())}"
    out = cli(environ, "submit", SPEC, f"name={name}", "trainer.max_steps=400", "trainer.log_every_n_steps=1",
              "logging.heartbeat_every_n_steps=1", "checkpoint.every_n_steps=1000", *OVERRIDES[:2])
    job = re.search(r"job (\d+)", out).group(1)
    run_dir = root / "runs" / name
    try:
        poll("the probe's 300th step", lambda: len(steps(run_dir, 1)) >= 300, timeout=600, job_id=job)
    finally:
        slurm.cancel([job])
        rehearsal.wait_for(job, {"completed", "failed", "cancelled", "timeout"}, timeout=120, poll=0.5)
    times = [b["time"] for b in steps(run_dir, 1)][50:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def run(minutes: float, every: float, keep: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-goodput-"))
    environ = dict(os.environ, LMLAUNCH_HOME=str(root / "home"), LMLAUNCH_RUNS_ROOT=str(root / "runs"))
    step_s = probe_step_s(environ, root)
    max_steps = int(minutes * 60 / step_s)
    name = f"bench-goodput-{int(time.time())}"
    out = cli(environ, "submit", SPEC, f"name={name}", f"trainer.max_steps={max_steps}",
              f"checkpoint.every_n_steps={max(50, max_steps // 20)}", "checkpoint.keep_last=2", *OVERRIDES)
    job = re.search(r"job (\d+)", out).group(1)
    run_dir = root / "runs" / name
    started = time.time()
    preemptions = 0
    state = "?"
    try:
        poll("the first step", lambda: steps(run_dir, 1), timeout=300, job_id=job)
        while True:
            target = started + (preemptions + 1) * every * 60
            while time.time() < target and not (run_dir / "DONE").exists():
                time.sleep(1.0)
            if (run_dir / "DONE").exists() or time.time() - started > (minutes - every / 2) * 60:
                break
            attempt = preemptions + 1
            cli(environ, "preempt", name, "--mode", "requeue", "--start-now")
            preemptions += 1
            poll(f"attempt {attempt + 1}'s first step", lambda a=attempt: steps(run_dir, a + 1), timeout=300,
                 job_id=job)
        state = rehearsal.wait_for(job, {"completed", "failed", "cancelled", "timeout"}, timeout=max(600, minutes * 60),
                                   poll=1.0, start_requeued=True)
    finally:
        if slurm.is_active(slurm.job_state(job)):
            slurm.cancel([job])
    history = json.loads(cli(environ, "history", name, "--json"))
    ends = {e["attempt"]: e for e in ledger(run_dir, "end")}
    rows = []
    for a in history["attempts"]:
        n = a["attempt"]
        first = (steps(run_dir, n) or [None])[0]
        prev = ends.get(n - 1)
        rows.append({
            "attempt": n, "reason": a["reason"], "steps": [a["start_step"], a["end_step"]],
            "train_s": round(a["train_s"] or 0.0, 1), "alloc_s": round(a["alloc_s"] or 0.0, 1),
            "steps_lost": a["steps_lost"],
            "restart_s": round(first["time"] - prev["time"], 2) if prev and first else None,
            "startup_s": a.get("startup_total_s"),
            "startup_phases_s": a.get("startup"),
        })
    lost = [r["steps_lost"] for r in rows if r["steps_lost"] is not None]
    restarts = [r["restart_s"] for r in rows if r["restart_s"] is not None]
    goodput = history["goodput"]
    line = {
        "bench": "goodput", "spec": "jobs/tiny-cpu.yaml", "minutes": minutes, "preempt_every_min": every,
        "final_state": state, "wall_s": round(time.time() - started, 1), "baseline_step_s": round(step_s, 4),
        "max_steps": max_steps, "preemptions": preemptions, "goodput": goodput,
        "steps_lost_per_preemption": lost, "restart_s_per_preemption": restarts,
        "attempts": rows, "goal_goodput": GOAL,
        "meets_goal": state == "COMPLETED" and goodput is not None and goodput >= GOAL and all(x <= 1 for x in lost),
    }
    if keep:
        print(f"run dir kept: {run_dir}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--every", type=float, default=4.0, help="minutes between preemptions")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    a = p.parse_args(argv)
    line = run(a.minutes, a.every, a.keep)
    print(json.dumps(line))
    return 0 if line["final_state"] == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
