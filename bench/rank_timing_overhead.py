"""What per-rank step timing costs a step: lmtrain.observe.rank_timing's hooks against the step
of the tiny job and of GPT-2 124M on CPU, measured in the same run.

- the timing's cost: :class:`RankTiming`'s hooks called as Lightning calls them for one optimizer
  step (batch start, before and after backward, before the optimizer step, batch end, the
  boundary mark), a logging line every ``log_every`` steps written to a real file; the median
  over ``--rounds`` rounds of ``--calls`` steps, per step;
- the baselines: one optimizer step (forward, backward, AdamW) of the tiny job's model
  (jobs/tiny-cpu.yaml's shape) and of GPT-2 124M (12 layers, 768 wide, T=128, B=1) on this
  machine's CPU, the median of a few steps after a warm-up.

Goal: **the timing costs <= 1 % of a step of each**. The straggler watch runs on rank 0 in a
thread woken at logging steps and is not on the step's path. Ends with one JSON object.

    python bench/rank_timing_overhead.py [--calls 20000] [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

GOAL = 0.01


def timing_cost_s(calls: int, rounds: int, log_every: int) -> float:
    """Seconds per optimizer step that RankTiming's hooks take (median over rounds)."""
    from lmtrain.observe.rank_timing import RankTiming

    per_step = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            timing = RankTiming(Path(tmp) / f"timing-{r}.jsonl", rank=0, node="n1", log_every_n_steps=log_every,
                                cuda=False)
            trainer = SimpleNamespace(global_step=0, max_steps=calls + 1)
            mark = timing.boundary_mark()
            timing.on_train_start(trainer, None)
            began = time.perf_counter()
            for step in range(1, calls + 1):
                timing.on_train_batch_start(trainer, None, None, 0)
                timing.on_before_backward(trainer, None, None)
                timing.on_after_backward(trainer, None)
                timing.on_before_optimizer_step(trainer, None, None)
                trainer.global_step = step
                timing.on_train_batch_end(trainer, None, None, None, 0)
                mark.on_train_batch_end(trainer, None, None, None, 0)
            per_step.append((time.perf_counter() - began) / calls)
            timing.teardown(trainer, None, "fit")
    return statistics.median(per_step)


def step_s(config: dict, *, batch: int, seq: int, steps: int) -> float:
    """Median seconds of one optimizer step (forward, backward, AdamW) of a GPT-2 of this shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config["vocab_size"], (batch, seq))
    times = []
    for i in range(steps + 1):
        began = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - began)
    return statistics.median(times)


TINY = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 260}  # jobs/tiny-cpu.yaml
GPT2_124M = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="steps timed per baseline model")
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()
    cost = timing_cost_s(args.calls, args.rounds, args.log_every)
    tiny = step_s(TINY, batch=8, seq=128, steps=args.steps)
    big = step_s(GPT2_124M, batch=1, seq=128, steps=args.steps)
    ratios = {"tiny": cost / tiny, "gpt2_124m": cost / big}
    print(f"rank timing: {cost * 1e6:.1f} us a step; tiny job step {tiny * 1e3:.1f} ms ({ratios['tiny']:.4%}); "
          f"GPT-2 124M step {big * 1e3:.0f} ms ({ratios['gpt2_124m']:.5%}); goal <= {GOAL:.0%} of each")
    print(json.dumps({"timing_us_per_step": round(cost * 1e6, 2), "tiny_step_ms": round(tiny * 1e3, 2),
                      "gpt2_124m_step_ms": round(big * 1e3, 1), "fraction_of_tiny_step": round(ratios["tiny"], 6),
                      "fraction_of_gpt2_124m_step": round(ratios["gpt2_124m"], 7),
                      "meets_goal": all(r <= GOAL for r in ratios.values()), "torch": torch.__version__,
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
