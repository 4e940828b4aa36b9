"""What a task's imports cost with Python's garbage collector paused against running, in the same run.

Every SLURM task (and every rank a local launch cannot fork from a zygote) starts a fresh
interpreter that imports torch, Lightning (with torchmetrics and torch._dynamo) and transformers
before it can train: most of a short attempt's CPU. ``lmtrain.observe.startup.imports_without_gc`` pauses
the cyclic collector while they load. Here each side is a fresh interpreter doing the task's imports
(``lmtrain.preemption`` and the frameworks, as ``lmtrain.task.entry.run_task`` does), ``--runs`` times,
alternating; the figure is each process's own CPU time (user + system, from ``wait4``).

Goal: **the task's imports take at most 0.9x the CPU with the collector paused** (medians).
Ends with one JSON object.

    python bench/task_imports.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.9

IMPORTS = """
import lmtrain.preemption.controller, lightning.pytorch, torch, transformers
from transformers import GPT2LMHeadModel
"""
PAUSED = "from lmtrain.observe.startup import imports_without_gc\nwith imports_without_gc(freeze=True):\n" + "".join(
    f"    {line}\n" for line in IMPORTS.strip().splitlines())


def _cpu_of(code: str) -> float:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the import process exited with {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="fresh interpreters per side (alternating)")
    args = ap.parse_args(argv)
    _cpu_of(IMPORTS)  # once, unmeasured: the files in the page cache and every .pyc written
    base: list[float] = []
    paused: list[float] = []
    for _ in range(args.runs):
        base.append(_cpu_of(IMPORTS))
        paused.append(_cpu_of(PAUSED))
    b, p = statistics.median(base), statistics.median(paused)
    ratio = p / b
    print(f"task imports, CPU-s per process (median of {args.runs}): collector running {b:.2f}, "
          f"paused {p:.2f}: {ratio:.2f}x (goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'})")
    print(json.dumps({
        "bench": "task_imports", "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
        "runs": args.runs, "cpu_s_gc_running": [round(x, 3) for x in base],
        "cpu_s_gc_paused": [round(x, 3) for x in paused], "median_running": round(b, 3),
        "median_paused": round(p, 3), "ratio": round(ratio, 3), "goal": GOAL, "met": ratio <= GOAL,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
