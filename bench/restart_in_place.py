"""A crashed rank: failure -> first step again, restarted in place against requeued, on the real
local SLURM cluster, all measured in the same run.

Three runs of jobs/tiny-cpu.yaml (2 nodes x 1 task, gloo), each with rank 1 SIGKILLed at step
``--kill-step`` of its first attempt (lmtrain.faults, as the OOM killer would):

- ``in_place``: the default, `preemption.restart_in_place: true` with `warm_restart: true`: rank 0
  decides the restart and each task's agent (lmtrain.task.agent) forks the training process again
  inside the same srun step, the frameworks already imported;
- ``in_place_srun``: `warm_restart: false`: rank 0 asks the batch script to run srun again in the
  same allocation (new processes, the imports again);
- ``requeue``: `preemption.restart_in_place: false`: rank 0 requeues the job (scontrol requeue),
  which waits in the queue as SLURM makes it (the local cluster's requeue BeginTime, ~2 min; not
  started early) and starts again.

For each: ``failure_to_first_step_s`` (the first attempt's end line -> the second attempt's first
step line in the heartbeat), and for the requeue its ``queue_wait_s`` (the end line -> the job's
new StartTime) and the rest without it. The ratio: in place over the requeue path without its
queue wait (goal: <= 0.5) and the in-place figure itself (goal: under 20 s for the tiny job on
this machine). One JSON object at the end.

    python bench/restart_in_place.py [--kill-step 12] [--keep]

The cluster must be up (`lmlaunch cluster up`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from preemption import SPEC, cli, jsonl  # bench/preemption.py: the same job and the CLI in-process

from lmcore.slurm import client as slurm

MODES = {"in_place": ("preemption.restart_in_place=true", "preemption.warm_restart=true"),
         "in_place_srun": ("preemption.restart_in_place=true", "preemption.warm_restart=false"),
         "requeue": ("preemption.restart_in_place=false",)}


def one(environ: dict[str, str], root: Path, name: str, kill_step: int, mode: str) -> dict:
    rule = {"point": "train.batch_end", "attempt": 1, "step": kill_step, "rank": 1, "action": "kill"}
    os.environ["LMLAUNCH_FAULTS"] = json.dumps([rule])  # SLURM hands the job the submitting environment
    try:
        out = cli(environ, "submit", SPEC, f"name={name}", "trainer.max_steps=40", "trainer.val_check_interval=null",
                  "checkpoint.every_n_steps=5", "optim.warmup_steps=2", *MODES[mode])
    finally:
        os.environ.pop("LMLAUNCH_FAULTS", None)
    job = re.search(r"job (\d+)", out).group(1)
    run_dir = root / name
    deadline = time.monotonic() + 900
    while slurm.state_group(slurm.job_state(job)) not in ("completed", "failed", "cancelled", "timeout"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: job {job} did not end within 15 minutes")
        time.sleep(1.0)
    ledger = jsonl(run_dir / "attempts.jsonl")
    ends = [e for e in ledger if e.get("event") == "end"]
    if len(ends) < 2 or ends[-1].get("reason") != "completed":
        raise SystemExit(f"{name}: expected a crash then a completion, got {ends}")
    crash_t = float(ends[0]["time"])
    first = min(float(b["time"]) for b in jsonl(run_dir / "metrics" / "heartbeat.jsonl")
                if b.get("event") == "step" and b.get("attempt") == 2)
    startup = next((e for e in ledger if e.get("event") == "startup" and e.get("attempt") == 2), {})
    row = {"mode": mode, "job": job, "attempt_2_startup_phases": startup.get("phases"),
           "attempt_2_process_start_after_end_s": round(float(startup["process_start"]) - crash_t, 2)
           if "process_start" in startup else None, "detail": ends[0].get("detail", "")[-90:],
           "slurm_restarts": slurm.restart_count(job), "failure_to_first_step_s": round(first - crash_t, 2)}
    if mode == "requeue":
        start = next(float(e["time"]) for e in ledger if e.get("event") == "start" and e.get("attempt") == 2)
        acct = [a for a in slurm.sacct([job], duplicates=True) if a.job_id == job]
        started = max((slurm.parse_time(a.start) or 0.0) for a in acct) if acct else start
        row["queue_wait_s"] = round(max(0.0, started - crash_t), 2)
        row["without_queue_wait_s"] = round(row["failure_to_first_step_s"] - row["queue_wait_s"], 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kill-step", type=int, default=12)
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = ap.parse_args()
    if not slurm.ping():
        raise SystemExit("the SLURM controller does not answer: `lmlaunch cluster up`")
    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-in-place-"))
    environ = {**os.environ, "LMLAUNCH_HOME": str(tmp / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp / "runs")}
    try:
        stamp = time.strftime("%H%M%S")
        in_place = one(environ, tmp / "runs", f"bench-rip-{stamp}-a", args.kill_step, "in_place")
        by_srun = one(environ, tmp / "runs", f"bench-rip-{stamp}-c", args.kill_step, "in_place_srun")
        requeue = one(environ, tmp / "runs", f"bench-rip-{stamp}-b", args.kill_step, "requeue")
        base = requeue["without_queue_wait_s"]
        summary = {"in_place_s": in_place["failure_to_first_step_s"],
                   "in_place_by_new_srun_s": by_srun["failure_to_first_step_s"],
                   "requeue_s": requeue["failure_to_first_step_s"],
                   "requeue_queue_wait_s": requeue["queue_wait_s"], "requeue_without_queue_wait_s": base,
                   "ratio_in_place_to_requeue_without_wait": round(in_place["failure_to_first_step_s"] / base, 3)
                   if base > 0 else None,
                   "ratio_warm_to_new_srun": round(in_place["failure_to_first_step_s"] / by_srun["failure_to_first_step_s"], 3)
                   if by_srun["failure_to_first_step_s"] > 0 else None,
                   "in_place_slurm_restarts": in_place["slurm_restarts"],
                   "requeue_slurm_restarts": requeue["slurm_restarts"]}
        summary["meets_goal"] = bool(summary["ratio_in_place_to_requeue_without_wait"] is not None
                                     and summary["ratio_in_place_to_requeue_without_wait"] <= 0.5
                                     and summary["in_place_s"] < 20)
        print(json.dumps(summary), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
