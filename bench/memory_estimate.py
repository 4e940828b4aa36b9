"""The memory plan's model states against DeepSpeed's own estimator and against what real CPU runs
held, as ratios.

    python bench/memory_estimate.py [--no-runs]

1. For the shipped GPU jobs, one rank's parameters + gradients + optimizer states under ZeRO-2 and
   ZeRO-3 as launcher.planning.memory plans them, next to DeepSpeed's
   ``estimate_zero{2,3}_model_states_mem_needs`` (no offload) for the same parameter count and
   GPUs. DeepSpeed's figure counts 18 bytes per parameter per rank beside the 16-bit weights (its
   fp32 gradient partition, made at the optimizer step, included) and, for ZeRO-3, 4 bytes per
   element of the largest layer; the plan counts what the engine holds entering the step.
2. Unless --no-runs: tiny CPU runs (lmtrain's real entry, 2 ranks) for each strategy, the worst
   rank's held bytes (the ledger's memory line) over the plan's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.planning import memory
from launcher.planning.memory_check import setup_of
from launcher.planning.memory_inputs import model_facts
from launcher.planning.resolve import resolve
from lmcore.job.parallelism import DataParallel

JOBS = ["gpt2-124m.yaml", "llama-1b-zero2.yaml", "llama-7b-zero3.yaml"]
STATES = ("parameters", "gradients", "optimizer states")


def _states(facts: memory.ModelFacts, setup: memory.Setup) -> int:
    return sum(r.bytes for r in memory.estimate(facts, setup).rows if r.name in STATES)


def against_deepspeed() -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    print(f"{'job':<22} {'ranks':>5} {'params':>14}  {'stage':>5} {'plan GB':>9} {'DeepSpeed GB':>13} {'plan/DS':>8}")
    for job in JOBS:
        r = resolve(str(REPO / "jobs" / job), ["trainer.precision=bf16-mixed"], force=True)
        facts = model_facts(r.spec)
        ranks = r.plan.topology.world_size
        largest_layer = max(p[0] for p in facts.params)
        for stage in (2, 3):
            setup = setup_of(r.spec, r.plan)
            setup = dataclasses.replace(setup, parallelism=setup.parallelism.with_data(DataParallel.ZERO, stage),
                                        offload_optimizer=False, offload_params=False)
            ours = _states(facts, setup)
            if stage == 2:
                _, theirs = estimate_zero2_model_states_mem_needs(facts.total, ranks, 1, cpu_offload=False)
            else:
                _, theirs, _ = estimate_zero3_model_states_mem_needs(facts.total, largest_layer, ranks, 1, cpu_offload=False)
            print(f"{job:<22} {ranks:>5} {facts.total:>14,}  {stage:>5} {ours / 1e9:>9.2f} {theirs / 1e9:>13.2f} "
                  f"{ours / theirs:>8.3f}")


def measured_on_cpu() -> None:
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch
    from tests.memory_helpers import held_against_estimate

    strategies = {"ddp": [], "fsdp": ["trainer.strategy=fsdp"],
                  **{f"zero{z}": ["trainer.strategy=deepspeed", f"trainer.zero_stage={z}"] for z in (1, 2, 3)}}
    print(f"\n{'strategy':<8} {'ranks':>5} {'held/plan params':>17} {'grads':>7} {'optimizer':>10}")
    with tempfile.TemporaryDirectory() as root:
        os.environ["LMLAUNCH_RUNS_ROOT"] = root
        for name, extra in strategies.items():
            plan = prepare_local_run(str(REPO / "jobs" / "tiny-cpu.yaml"),
                                     ["trainer.precision=bf16-mixed", "trainer.limit_val_batches=0", *extra],
                                     devices=2, max_steps=2, name=f"bench-{name}", environ=dict(os.environ),
                                     say=lambda *_: None)
            code = launch(plan.paths.run_dir, 2, plan_env=plan.env, threads_per_proc=1,
                          out=open(Path(plan.paths.run_dir) / "out.txt", "w"))
            if code != 0:
                print(f"{name:<8} failed (exit {code}): {plan.paths.run_dir}/out.txt")
                continue
            got = held_against_estimate(plan.paths.run_dir)[0]
            ratios = [got[k][0] / got[k][1] for k in ("params", "grads", "optimizer")]
            print(f"{name:<8} {got['world_size']:>5} {ratios[0]:>17.4f} {ratios[1]:>7.4f} {ratios[2]:>10.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-runs", action="store_true", help="only the comparison with DeepSpeed's estimator")
    args = p.parse_args()
    against_deepspeed()
    if not args.no_runs:
        measured_on_cpu()


if __name__ == "__main__":
    main()
