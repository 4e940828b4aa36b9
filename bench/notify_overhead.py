"""Step time of a run whose webhook is unreachable vs the same run without notifications, in the
same invocation (alternating order), on the tiny CPU model through the real entry (1 process).

The webhook is a blackhole (a TCP listener that accepts and never answers, so every delivery
waits its whole timeout and retries): the messages are sent from a background thread, so the
step time must not change; the attempt's end may wait up to lmtrain.observe.notify.CLOSE_WAIT_S for the
queue (reported as ``end_wait_s``, from the last step line to the process exit).

usage: python bench/notify_overhead.py [--steps 60] [--repeat 2] [--json]
Ends by printing one JSON object with the figures, the baseline and ``meets_goal`` (median step
time ratio <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _blackhole() -> tuple[socket.socket, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)  # accepted by the kernel, never read or answered
    return s, f"http://127.0.0.1:{s.getsockname()[1]}/hook"


def _run(name: str, steps: int, root: Path, webhook: str | None) -> dict:
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch

    overrides = ["trainer.limit_val_batches=0", "trainer.val_check_interval=null", "trainer.log_every_n_steps=1",
                 "checkpoint.every_n_steps=1000", "data.num_workers=0"]
    if webhook:
        overrides += [f"notify.webhooks=[{{url: '{webhook}'}}]", "notify.timeout_s=5", "notify.retries=2"]
    plan = prepare_local_run(str(REPO / "jobs" / "tiny-cpu.yaml"), overrides, devices=1, max_steps=steps, name=name,
                             environ={**os.environ, "LMLAUNCH_RUNS_ROOT": str(root)}, say=lambda *_: None)
    with open(Path(plan.paths.run_dir) / "bench.out", "w") as out:
        assert launch(plan.paths.run_dir, 1, plan_env=plan.env, out=out, threads_per_proc=1) == 0
    ended = time.time()
    beats = [json.loads(x) for x in (Path(plan.paths.run_dir) / "metrics" / "heartbeat.jsonl").read_text().splitlines()]
    steps_ = [b for b in beats if b["event"] == "step"]
    intervals = [b["time"] - a["time"] for a, b in zip(steps_, steps_[1:]) if b["step"] > 5]
    return {"step_s": statistics.median(intervals), "end_wait_s": round(ended - steps_[-1]["time"], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    hole, url = _blackhole()
    base, dead = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            order = [("base", None), ("dead", url)] if i % 2 == 0 else [("dead", url), ("base", None)]
            for label, hook in order:
                r = _run(f"notify-{label}-{i}", args.steps, Path(tmp), hook)
                (base if label == "base" else dead).append(r)
                if not args.json:
                    print(f"{label:4s} #{i}: step {r['step_s'] * 1000:.1f} ms, end wait {r['end_wait_s']} s", flush=True)
    hole.close()
    b = statistics.median(r["step_s"] for r in base)
    d = statistics.median(r["step_s"] for r in dead)
    result = {"bench": "notify_overhead", "steps": args.steps, "repeat": args.repeat,
              "baseline_step_ms": round(b * 1000, 2), "unreachable_webhook_step_ms": round(d * 1000, 2),
              "ratio": round(d / b, 3), "end_wait_s": {"baseline": [r["end_wait_s"] for r in base],
                                                       "unreachable": [r["end_wait_s"] for r in dead]},
              "meets_goal": d / b <= 1.05}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
