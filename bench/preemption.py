"""Preemption cost on the real local SLURM cluster: time from the signal to a complete
checkpoint, and steps lost per preemption, against the run's own step time measured in the
same run (the steady steps of its first attempt, before any signal).

One run of jobs/tiny-cpu.yaml (2 nodes x 1 task, gloo) is stopped twice:

1. the warning signal (`lmlaunch preempt --mode signal`: the plan's USR2 to every task, what
   SLURM sends before the time limit); the job checkpoints and requeues itself;
2. a real preemption (`lmlaunch preempt --mode requeue`: an exclusive job on the high-priority
   partition; SIGTERM only unless the cluster runs with preempt_send_user_signal);

then it runs to the end. Prints one JSON line per stop and a summary line:

- ``signal_to_checkpoint_s``: from the signal's arrival in the task (the runtime's ledger
  ``signal_time``) to the stop checkpoint's heartbeat line (written when it is COMPLETE);
  ``ratio_to_step``: that over the baseline step time;
- ``steps_after_signal``: the stop step minus the last step finished before the signal (the
  step in flight is finished, so 1 is the best possible; goal: at most 1 with the warning);
- ``steps_lost``: steps the next attempt has to redo (highest step reached minus its start step);
- ``restart_s``: from the checkpoint to the next attempt's first step (requeue, start, imports).

    python bench/preemption.py [--max-steps 120] [--keep]

The cluster must be up (`lmlaunch cluster up`). Requeued jobs are started at once (the
~2 min BeginTime delay of a requeue is SLURM policy, not lmlaunch cost).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launcher.cli import main as lmlaunch
from launcher.context import Context
from lmcore.slurm import admin as rehearsal, client as slurm

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "jobs" / "tiny-cpu.yaml"


def cli(environ: dict[str, str], *args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = lmlaunch([str(a) for a in args], Context(stdout=out, stderr=err, environ=dict(environ)))
    if code != 0:
        raise SystemExit(f"lmlaunch {' '.join(map(str, args))} exited {code}: {out.getvalue()}{err.getvalue()}")
    return out.getvalue()


def jsonl(path: Path) -> list[dict]:
    from lmcore.jsonlines import read_jsonl  # skips a line being written

    return read_jsonl(path)


def steps(run_dir: Path, attempt: int) -> list[dict]:
    return [b for b in jsonl(run_dir / "metrics" / "heartbeat.jsonl") if b.get("event") == "step" and b["attempt"] == attempt]


def ledger(run_dir: Path, event: str) -> list[dict]:
    return [e for e in jsonl(run_dir / "attempts.jsonl") if e.get("event") == event]


def poll(what: str, fn, timeout: float = 240.0, job_id: str | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        if job_id is not None:
            info = slurm.show_job(job_id) or {}
            if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                rehearsal.start_now(job_id)
        time.sleep(0.1)


def stop_record(run_dir: Path, attempt: int, kind: str, baseline_s: float, sent_at: float) -> dict:
    end = next(e for e in ledger(run_dir, "end") if e["attempt"] == attempt)
    nxt = poll(f"attempt {attempt + 1}", lambda: next((s for s in ledger(run_dir, "start") if s["attempt"] == attempt + 1), None))
    first_step = poll(f"a step of attempt {attempt + 1}", lambda: (steps(run_dir, attempt + 1) or [None])[0])
    beats = jsonl(run_dir / "metrics" / "heartbeat.jsonl")
    signal_at = end.get("signal_time") or sent_at
    stop_step = end.get("stop_step", end["end_step"])
    ckpt = next((b for b in beats if b.get("event") == "checkpoint" and b["attempt"] == attempt and b["step"] == stop_step), None)
    before = [b["step"] for b in steps(run_dir, attempt) if b["time"] <= signal_at]
    reached = max(b["step"] for b in steps(run_dir, attempt))
    ckpt_at = ckpt["time"] if ckpt else None
    sig_to_ckpt = round(ckpt_at - signal_at, 3) if ckpt_at else None
    return {
        "bench": "preemption",
        "stop": kind,
        "attempt": attempt,
        "reason": end["reason"],
        "signal": end.get("signal"),
        "sent_to_arrival_s": round(signal_at - sent_at, 3),
        "signal_to_checkpoint_s": sig_to_ckpt,
        "runtime_checkpoint_seconds": end.get("checkpoint_seconds"),
        "baseline_step_s": round(baseline_s, 4),
        "ratio_to_step": round(sig_to_ckpt / baseline_s, 2) if sig_to_ckpt else None,
        "steps_after_signal": stop_step - max(before, default=nxt["start_step"]),
        "steps_lost": reached - nxt["start_step"],
        "stop_step": stop_step,
        "resumed_at": nxt["start_step"],
        "restart_s": round(first_step["time"] - (ckpt_at or end["time"]), 3),
    }


def run(max_steps: int, keep: bool) -> int:
    root = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-preempt-"))
    environ = dict(__import__("os").environ, LMLAUNCH_HOME=str(root / "home"), LMLAUNCH_RUNS_ROOT=str(root / "runs"))
    name = f"bench-preempt-{int(time.time())}"
    out = cli(environ, "submit", SPEC, f"name={name}", f"trainer.max_steps={max_steps}", "optim.warmup_steps=3",
              "trainer.val_check_interval=null", "trainer.log_every_n_steps=1", "logging.heartbeat_every_n_steps=1",
              f"checkpoint.every_n_steps={max_steps // 4}")
    job = re.search(r"job (\d+)", out).group(1)
    run_dir = root / "runs" / name
    records = []
    try:
        # baseline: steady step time of attempt 1 (the first steps include warm-up)
        poll("step 25", lambda: len(steps(run_dir, 1)) >= 25)
        times = [b["time"] for b in steps(run_dir, 1)][5:]
        baseline = statistics.median(b - a for a, b in zip(times, times[1:]))

        sent = time.time()
        cli(environ, "preempt", name, "--mode", "signal")
        poll("the end of attempt 1", lambda: any(e["attempt"] == 1 for e in ledger(run_dir, "end")), job_id=job)
        poll("attempt 2", lambda: len(steps(run_dir, 2)) >= 15, job_id=job)
        records.append(stop_record(run_dir, 1, "warning_signal", baseline, sent))

        sent = time.time()
        cli(environ, "preempt", name, "--mode", "requeue", "--start-now")
        poll("the end of attempt 2", lambda: any(e["attempt"] == 2 for e in ledger(run_dir, "end")), job_id=job)
        records.append(stop_record(run_dir, 2, "preemption_" + ("user_signal" if "preempt_send_user_signal" in
                                   slurm.config().get("SlurmctldParameters", "") else "sigterm"), baseline, sent))
        state = rehearsal.wait_for(job, {"completed", "failed", "cancelled", "timeout"}, timeout=300, poll=1.0,
                               start_requeued=True)
    finally:
        if slurm.is_active(slurm.job_state(job)):
            slurm.cancel([job])
    for r in records:
        print(json.dumps(r))
    warning = records[0]
    print(json.dumps({
        "bench": "preemption_summary", "final_state": state, "baseline_step_s": round(baseline, 4),
        "warning_steps_after_signal": warning["steps_after_signal"],
        "warning_goal_at_most_1_step": warning["steps_after_signal"] <= 1,
        "steps_lost": [r["steps_lost"] for r in records],
        "signal_to_checkpoint_s": [r["signal_to_checkpoint_s"] for r in records],
    }))
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"run dir kept: {run_dir}", file=sys.stderr)
    return 0 if state == "COMPLETED" else 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    sys.exit(run(a.max_steps, a.keep))
