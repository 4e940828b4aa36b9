"""The stop's checkpoint, staged: how long a preemption holds training, how long until the
checkpoint is durable, and ``dd conv=fsync`` of the same bytes to the same directory, in one run.

A GPT-2 124M (fp32 weights + AdamW state: about 1.5 GB) trains on CPU in 2 local processes
(``lmtrain.local.launch``, as `lmlaunch run --local` starts them; DDP on gloo, or ``--strategy``)
with no periodic checkpoint before the stop: every rank sends itself SIGTERM at the end of step
``--stop-at`` (the fault seam's ``sigterm`` action: what SLURM sends at a preemption), the ranks
agree to stop at that boundary and save. This is the hard case: the stop's save is the attempt's
first, so its host buffers exist only because they were reserved at the first step boundary
(``CheckpointManager.reserve``).

Figures, from the run's own records:

- ``held_s``: what the stop's save held training for (the heartbeat's ``blocked_s``; the ledger's
  ``checkpoint_held_s``): the copy of each rank's state into host memory;
- ``durable_s``: the save's start to its COMPLETE marker, fsynced (the heartbeat's ``seconds``);
  the attempt ends, and a SLURM attempt requeues, only after it;
- ``signal_to_durable_s``: the ledger's ``checkpoint_seconds`` (SIGTERM to COMPLETE);
- ``dd_s``: ``dd if=/dev/zero bs=64M conv=fsync`` of the checkpoint's bytes into the checkpoint
  directory, median of 3, page cache dropped before each (root).

The same run with ``checkpoint.async_save=false`` (the synchronous stop, what every stop was
before) is measured first as the reference (``--no-reference`` skips it): its save holds training
until durable.

CPU goals: held <= 0.25x durable; durable <= 1.2x dd.

    python bench/stop_checkpoint.py [--strategy ddp|fsdp|zero1|zero2|zero3] [--stop-at 3]

Ends with one JSON object: the figures, the reference, the baselines and ``meets_goal``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import REPO, SHAPES, STRATEGIES, dd_seconds, drop_page_cache, median_of, require_memory

GOAL_HELD_TO_DURABLE = 0.25
GOAL_DURABLE_TO_DD = 1.2


def stop_run(spec: str, extra: tuple[str, ...], work: Path, stop_at: int, name: str) -> dict:
    """Train until every rank SIGTERMs itself after step ``stop_at``; the stop's records."""
    from launcher.submit.local_run import prepare_local_run
    from lmcore.jsonlines import read_jsonl
    from lmtrain.local.launch import launch

    overrides = [
        f"data.path={REPO / 'data' / 'prepared' / 'tiny'}", "data.seq_len=32", "data.micro_batch_size=1",
        "data.num_workers=0", "trainer.global_batch_size=2", "trainer.precision=32-true",
        "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
        "model.compile=false", "checkpoint.every_n_steps=100000", "checkpoint.keep_last=2",
        "watchdog.hang_timeout_s=1200", *extra,
    ]
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(work / "runs")}
    plan = prepare_local_run(str(REPO / spec), overrides, devices=2, max_steps=stop_at + 20, name=name, environ=env,
                             new=True, say=lambda m: print(m, file=sys.stderr))
    rule = [{"point": "train.batch_end", "step": stop_at, "action": "sigterm"}]  # every rank, as SLURM signals
    old = os.environ.get("LMLAUNCH_FAULTS")
    os.environ["LMLAUNCH_FAULTS"] = json.dumps(rule)
    try:
        code = launch(plan.paths.run_dir, 2, plan_env=plan.env, out=sys.stderr, threads_per_proc=1)
    finally:
        if old is None:
            os.environ.pop("LMLAUNCH_FAULTS", None)
        else:
            os.environ["LMLAUNCH_FAULTS"] = old
    ends = [e for e in read_jsonl(plan.paths.ledger) if e.get("event") == "end"]
    if code != 0 or not ends or ends[-1].get("reason") != "preempted":
        raise SystemExit(f"the run did not end preempted (exit {code}, ledger end {ends[-1:]}); logs in "
                         f"{plan.paths.run_dir}/logs")
    end = ends[-1]
    save = [b for b in read_jsonl(plan.paths.heartbeat) if b.get("event") == "checkpoint"][-1]
    ckpt = Path(save["path"])
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    from lmcore.run.rank_logs import rank_text

    logs = rank_text(Path(plan.paths.logs_dir, "attempt-1"), 0)
    reserved = [line for line in logs.splitlines() if "staging buffers reserved" in line]
    return {"stop_step": end["stop_step"], "held_s": save["blocked_s"], "durable_s": save["seconds"],
            "ledger_held_s": end.get("checkpoint_held_s"), "signal_to_durable_s": end.get("checkpoint_seconds"),
            "checkpoint_bytes": size, "checkpoint_dir": str(ckpt.parent),
            "reserved": reserved[-1].split("staging buffers reserved: ")[-1] if reserved else None}


def run(params: str, strategy: str, stop_at: int, work_root: str | None, reference: bool) -> dict:
    spec, extra = SHAPES[params]
    extra = (*extra, *STRATEGIES[strategy])
    require_memory(params)
    work = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-stop-ckpt-", dir=work_root))
    try:
        sync = None
        if reference:
            drop_page_cache()
            sync = stop_run(spec, (*extra, "checkpoint.async_save=false"), work, stop_at, "stop-sync")
        drop_page_cache()
        t0 = time.time()
        staged = stop_run(spec, (*extra, "checkpoint.async_save=true"), work, stop_at, "stop-staged")
        wall = time.time() - t0
        directory = Path(staged["checkpoint_dir"])
        dd = median_of(3, lambda: dd_seconds(directory / ".dd-baseline", staged["checkpoint_bytes"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    held, durable = staged["held_s"], staged["durable_s"]
    out = {
        "bench": "stop_checkpoint", "model": spec, "params": float(params), "ranks": 2,
        "strategy": f"{strategy} (gloo, CPU)", "stop_at_step": stop_at, "periodic_saves_before_the_stop": 0,
        "checkpoint_bytes": staged["checkpoint_bytes"],
        "held_s": held, "durable_s": durable, "signal_to_durable_s": staged["signal_to_durable_s"],
        "ledger_checkpoint_held_s": staged["ledger_held_s"], "staging_buffers_reserved": staged["reserved"],
        "baseline_dd_s": round(dd, 3), "dd_gb_s": round(staged["checkpoint_bytes"] / dd / 1e9, 3),
        "held_ratio_to_durable": round(held / durable, 3), "durable_ratio_to_dd": round(durable / dd, 3),
        "goal_held_ratio_to_durable": GOAL_HELD_TO_DURABLE, "goal_durable_ratio_to_dd": GOAL_DURABLE_TO_DD,
        "meets_goal": held / durable <= GOAL_HELD_TO_DURABLE and durable / dd <= GOAL_DURABLE_TO_DD,
        "staged_run_wall_s": round(wall, 1),
        "command": " ".join(["python", *sys.argv]),
    }
    if sync is not None:
        out["reference_synchronous_stop"] = {"held_s": sync["held_s"], "durable_s": sync["durable_s"],
                                             "signal_to_durable_s": sync["signal_to_durable_s"]}
        out["held_ratio_to_synchronous_stop"] = round(held / sync["held_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", choices=sorted(SHAPES), default="124e6")
    p.add_argument("--strategy", choices=list(STRATEGIES), default="ddp")
    p.add_argument("--stop-at", type=int, default=3, help="the step after which every rank gets SIGTERM (>= 2)")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    p.add_argument("--no-reference", action="store_true", help="skip the synchronous stop's reference run")
    a = p.parse_args(argv)
    if a.stop_at < 2:
        p.error("--stop-at must be >= 2 (the buffers are reserved at the first step boundary)")
    result = run(a.params, a.strategy, a.stop_at, a.dir, not a.no_reference)
    print(json.dumps(result))
    return 0 if result["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
