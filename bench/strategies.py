"""Step time and checkpoint save/load time of every strategy on the tiny CPU model, 2 processes
(gloo), each as a ratio to DDP measured in the same run.

For each strategy (ddp, fsdp, zero1, zero2, zero3) the same job (jobs/tiny-cpu.yaml, GPT-2
2 x 128, byte vocab, global batch 16 x 128 tokens, dropout as shipped) runs through the real
entry (`lmlaunch run --local`'s launcher) twice:

1. a fresh run of ``--steps`` optimizer steps with a checkpoint every ``--every`` steps;
2. ``--resume`` of that run to ``--steps + 5`` steps (it loads the newest checkpoint).

Figures, from the run's own heartbeat (metrics/heartbeat.jsonl):

- step time: the median interval between consecutive step lines of run 1, leaving out the
  first 5 steps and the steps that wrote a checkpoint;
- save: the median ``seconds`` of run 1's checkpoint lines (collective: every rank writes its
  shards; COMPLETE marker included);
- load: in run 2, from Lightning's "Restoring states from the checkpoint path" to its "Restored
  all states" (rank 0's log, logs/attempt-2/rank-0.log): reading the checkpoint into model,
  optimizer, scheduler and loops (every rank loads its shards at the same time).

usage: python bench/strategies.py [--steps 40] [--every 10] [--only ddp,zero3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STRATEGIES = {
    "ddp": ["trainer.strategy=ddp"],
    "fsdp": ["trainer.strategy=fsdp"],
    "zero1": ["trainer.strategy=deepspeed", "trainer.zero_stage=1"],
    "zero2": ["trainer.strategy=deepspeed", "trainer.zero_stage=2"],
    "zero3": ["trainer.strategy=deepspeed", "trainer.zero_stage=3"],
}


def _run(name: str, overrides: list[str], steps: int, every: int, runs_root: Path, resume: bool) -> list[dict]:
    from launcher.commands.run import prepare_local_run
    from lmtrain.local import launch

    environ = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(runs_root)}
    plan = prepare_local_run(
        str(REPO / "jobs" / "tiny-cpu.yaml"),
        [*overrides, "trainer.log_every_n_steps=1", "logging.heartbeat_every_n_steps=1", f"checkpoint.every_n_steps={every}",
         "checkpoint.keep_last=2", "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "data.num_workers=0"],
        devices=2, max_steps=steps, name=name, environ=environ, say=lambda *_: None, resume=resume,
    )
    with open(Path(plan.paths.run_dir) / "bench.out", "a") as out:
        code = launch(plan.paths.run_dir, 2, plan_env=plan.env, out=out, threads_per_proc=1)
    if code != 0:
        raise SystemExit(f"{name}: the run exited {code}; see {plan.paths.run_dir}")
    lines = [json.loads(x) for x in Path(plan.paths.heartbeat).read_text().splitlines()]
    attempt = max(x["attempt"] for x in lines)
    return [x for x in lines if x["attempt"] == attempt]


def _load_seconds(run_dir: Path) -> float:
    from datetime import datetime

    def stamp(line: str) -> float:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

    lines = (run_dir / "logs" / "attempt-2" / "rank-0.log").read_text().splitlines()
    begin = next(stamp(x) for x in lines if "Restoring states from the checkpoint path" in x and x[:4].isdigit())
    end = next(stamp(x) for x in lines if "Restored all states from the checkpoint" in x and x[:4].isdigit())
    return end - begin


def measure(strategy: str, steps: int, every: int, root: Path) -> dict:
    overrides = STRATEGIES[strategy]
    fresh = _run(f"bench-{strategy}", overrides, steps, every, root, resume=False)
    saved = {x["step"] for x in fresh if x["event"] == "checkpoint"}
    step_lines = [x for x in fresh if x["event"] == "step"]
    intervals = [b["time"] - a["time"] for a, b in zip(step_lines, step_lines[1:])
                 if b["step"] > 5 and a["step"] not in saved]
    saves = [x["seconds"] for x in fresh if x["event"] == "checkpoint"]
    _run(f"bench-{strategy}", overrides, steps + 5, every, root, resume=True)
    return {
        "strategy": strategy,
        "step_s": statistics.median(intervals),
        "save_s": statistics.median(saves),
        "saves": len(saves),
        "load_s": _load_seconds(root / f"bench-{strategy}"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--only", default=",".join(STRATEGIES), help="comma-separated strategies (ddp always runs: the baseline)")
    ap.add_argument("--json", action="store_true", help="one JSON line per strategy")
    args = ap.parse_args()
    chosen = ["ddp", *[s for s in args.only.split(",") if s and s != "ddp"]]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; allowed: {', '.join(STRATEGIES)}")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        rows = [measure(s, args.steps, args.every, Path(tmp)) for s in chosen]
    base = rows[0]
    for r in rows:
        r["step_ratio_to_ddp"] = r["step_s"] / base["step_s"]
        r["save_ratio_to_ddp"] = r["save_s"] / base["save_s"]
        r["load_ratio_to_ddp"] = r["load_s"] / base["load_s"] if base["load_s"] > 0 else None
    if args.json:
        for r in rows:
            print(json.dumps({"bench": "strategies", "steps": args.steps, **r}))
        return 0
    print(f"# bench/strategies.py: tiny GPT-2 on 2 CPU processes (gloo), {args.steps} steps, "
          f"checkpoint every {args.every}; {time.time() - started:.0f} s in all")
    print(f"{'strategy':9} {'step s':>8} {'x ddp':>6} {'save s':>8} {'x ddp':>6} {'load s':>8} {'x ddp':>6}")
    for r in rows:
        load_ratio = f"{r['load_ratio_to_ddp']:6.2f}" if r["load_ratio_to_ddp"] is not None else "   n/a"
        print(f"{r['strategy']:9} {r['step_s']:8.3f} {r['step_ratio_to_ddp']:6.2f} {r['save_s']:8.3f} "
              f"{r['save_ratio_to_ddp']:6.2f} {r['load_s']:8.3f} {load_ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
