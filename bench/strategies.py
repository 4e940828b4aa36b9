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
  all states" (rank 0's log, its lines in logs/attempt-2/node-0.log): reading the checkpoint into model,
  optimizer, scheduler and loops (every rank loads its shards at the same time).

Tensor parallelism (``--only tp2,tp2-sp,dp2xtp2``): jobs/tiny-cpu-tp.yaml's tiny Llama as tp2
(and with sequence parallelism) on 2 processes against DDP of the same model on 2
(``ddp-llama2``), and dp2xtp2 on 4 against DDP on 4 (``ddp-llama4``). On CPUs TP only adds
collectives (an all-reduce or gather per block, per direction): these ratios say what it costs
here, not what it saves on GPUs, where it splits memory and matmuls (unmeasured: no GPU).

Pipelines (``--only pp2-1f1b,pp2-gpipe``): that Llama with untied embeddings as 2 stages on 2
processes (4 microbatches of 4 per step) against DDP of the same model on 2 (``ddp-llama2-untied``);
the bubble each schedule predicts is printed under the table. On 2 CPU cores both stages share the
cores DDP's two replicas use: a figure of what the schedule and its point-to-point sends cost here.

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

_UNTIED = ["data.micro_batch_size=4", "model.config.tie_word_embeddings=false", "trainer.tensor_parallel_size=1",
           "trainer.sequence_parallel=false"]
STRATEGIES = {
    "ddp": ["trainer.strategy=ddp"],
    "fsdp": ["trainer.strategy=fsdp"],
    "zero1": ["trainer.strategy=deepspeed", "trainer.zero_stage=1"],
    "zero2": ["trainer.strategy=deepspeed", "trainer.zero_stage=2"],
    "zero3": ["trainer.strategy=deepspeed", "trainer.zero_stage=3"],
    # tensor parallelism: jobs/tiny-cpu-tp.yaml's Llama (GPT-2 has no TP plan), each against DDP of
    # the same model on the same number of processes, measured in the same run (micro batch 4: DDP on
    # 4 processes takes the global batch of 16 in one micro step)
    "ddp-llama2": ["data.micro_batch_size=4", "trainer.strategy=ddp", "trainer.tensor_parallel_size=1", "trainer.sequence_parallel=false"],
    "tp2": ["data.micro_batch_size=4", "trainer.tensor_parallel_size=2", "trainer.sequence_parallel=false"],
    "tp2-sp": ["data.micro_batch_size=4", "trainer.tensor_parallel_size=2", "trainer.sequence_parallel=true"],
    "ddp-llama4": ["data.micro_batch_size=4", "trainer.strategy=ddp", "trainer.tensor_parallel_size=1", "trainer.sequence_parallel=false"],
    "dp2xtp2": ["data.micro_batch_size=4", "trainer.tensor_parallel_size=2", "trainer.sequence_parallel=false"],
    # pipelines: the same Llama with untied embeddings (the embedding and the head on different stages)
    # as 2 stages on 2 processes, 4 microbatches of 4 per step, against DDP of that model on 2
    "ddp-llama2-untied": [*_UNTIED, "trainer.strategy=ddp"],
    "pp2-1f1b": [*_UNTIED, "trainer.pipeline_parallel_size=2", "trainer.pipeline_schedule=1f1b"],
    "pp2-gpipe": [*_UNTIED, "trainer.pipeline_parallel_size=2", "trainer.pipeline_schedule=gpipe"],
}
# (job, processes, the row each is compared with); the rest: tiny-cpu.yaml on 2, against ddp
LAYOUT = {"ddp-llama2": ("tiny-cpu-tp.yaml", 2, "ddp-llama2"), "tp2": ("tiny-cpu-tp.yaml", 2, "ddp-llama2"),
          "tp2-sp": ("tiny-cpu-tp.yaml", 2, "ddp-llama2"), "ddp-llama4": ("tiny-cpu-tp.yaml", 4, "ddp-llama4"),
          "dp2xtp2": ("tiny-cpu-tp.yaml", 4, "ddp-llama4"),
          **{k: ("tiny-cpu-tp.yaml", 2, "ddp-llama2-untied") for k in ("ddp-llama2-untied", "pp2-1f1b", "pp2-gpipe")}}


def _run(name: str, overrides: list[str], steps: int, every: int, runs_root: Path, resume: bool,
         job: str = "tiny-cpu.yaml", devices: int = 2) -> list[dict]:
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch

    environ = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(runs_root)}
    plan = prepare_local_run(
        str(REPO / "jobs" / job),
        [*overrides, "trainer.log_every_n_steps=1", "logging.heartbeat_every_n_steps=1", f"checkpoint.every_n_steps={every}",
         "checkpoint.keep_last=2", "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "data.num_workers=0"],
        devices=devices, max_steps=steps, name=name, environ=environ, say=lambda *_: None, resume=resume,
    )
    with open(Path(plan.paths.run_dir) / "bench.out", "a") as out:
        code = launch(plan.paths.run_dir, devices, plan_env=plan.env, out=out, threads_per_proc=1)
    if code != 0:
        raise SystemExit(f"{name}: the run exited {code}; see {plan.paths.run_dir}")
    lines = [json.loads(x) for x in Path(plan.paths.heartbeat).read_text().splitlines()]
    attempt = max(x["attempt"] for x in lines)
    return [x for x in lines if x["attempt"] == attempt]


def _load_seconds(run_dir: Path) -> float:
    from datetime import datetime

    def stamp(line: str) -> float:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

    from lmcore.run.rank_logs import rank_text

    lines = rank_text(run_dir / "logs" / "attempt-2", 0).splitlines()
    begin = next(stamp(x) for x in lines if "Restoring states from the checkpoint path" in x and x[:4].isdigit())
    end = next(stamp(x) for x in lines if "Restored all states from the checkpoint" in x and x[:4].isdigit())
    return end - begin


def measure(strategy: str, steps: int, every: int, root: Path) -> dict:
    overrides = STRATEGIES[strategy]
    job, devices, _ = LAYOUT.get(strategy, ("tiny-cpu.yaml", 2, "ddp"))
    fresh = _run(f"bench-{strategy}", overrides, steps, every, root, resume=False, job=job, devices=devices)
    saved = {x["step"] for x in fresh if x["event"] == "checkpoint"}
    step_lines = [x for x in fresh if x["event"] == "step"]
    intervals = [b["time"] - a["time"] for a, b in zip(step_lines, step_lines[1:])
                 if b["step"] > 5 and a["step"] not in saved]
    saves = [x["seconds"] for x in fresh if x["event"] == "checkpoint"]
    _run(f"bench-{strategy}", overrides, steps + 5, every, root, resume=True, job=job, devices=devices)
    return {
        "strategy": strategy,
        "processes": devices,
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
    asked = [s for s in args.only.split(",") if s]
    chosen: list[str] = []
    for s in asked:  # each with its baseline, measured first
        for name in (LAYOUT.get(s, (None, None, "ddp"))[2], s):
            if name not in chosen:
                chosen.append(name)
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; allowed: {', '.join(STRATEGIES)}")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        rows = [measure(s, args.steps, args.every, Path(tmp)) for s in chosen]
    by_name = {r["strategy"]: r for r in rows}
    for r in rows:
        base = by_name[LAYOUT.get(r["strategy"], (None, None, "ddp"))[2]]
        r["baseline"] = base["strategy"]
        r["step_ratio_to_ddp"] = r["step_s"] / base["step_s"]
        r["save_ratio_to_ddp"] = r["save_s"] / base["save_s"]
        r["load_ratio_to_ddp"] = r["load_s"] / base["load_s"] if base["load_s"] > 0 else None
    if args.json:
        for r in rows:
            print(json.dumps({"bench": "strategies", "steps": args.steps, **r}))
        return 0
    print(f"# bench/strategies.py: tiny GPT-2 (tiny Llama for the TP rows) on CPU processes (gloo), "
          f"{args.steps} steps, checkpoint every {args.every}; {time.time() - started:.0f} s in all; "
          f"'x base': the ratio to the baseline row named, same run")
    print(f"{'strategy':11} {'procs':>5} {'step s':>8} {'x base':>6} {'save s':>8} {'x base':>6} {'load s':>8} "
          f"{'x base':>6}  baseline")
    for r in rows:
        load_ratio = f"{r['load_ratio_to_ddp']:6.2f}" if r["load_ratio_to_ddp"] is not None else "   n/a"
        print(f"{r['strategy']:11} {r['processes']:5} {r['step_s']:8.3f} {r['step_ratio_to_ddp']:6.2f} "
              f"{r['save_s']:8.3f} {r['save_ratio_to_ddp']:6.2f} {r['load_s']:8.3f} {load_ratio}  {r['baseline']}")
    from lmcore.job.pipeline_stages import bubble_text

    for r in rows:  # what the schedule predicts: the stages idle this fraction of their compute
        if r["strategy"].startswith("pp2-"):
            print(f"# {r['strategy']}: {bubble_text(r['strategy'].split('-', 1)[1], 2, 4)} (4 microbatches, 2 stages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
