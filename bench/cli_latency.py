"""Wall time of `lmlaunch submit jobs/tiny-cpu.yaml --dry-run` and `lmlaunch validate`
against a bare `python -c pass` measured in the same run (same interpreter, same machine
load). Prints one JSON line: medians in seconds, ratios to the baseline, and whether each
command is under the 0.5 s target.

    python bench/cli_latency.py [--repeat 9] [--strict]

--strict exits 1 when a command misses the target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 0.5


def lmlaunch_command() -> list[str]:
    script = Path(sys.executable).with_name("lmlaunch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "launcher.cli"]


def median_wall(cmd: list[str], repeat: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.decode()}")
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--strict", action="store_true", help="exit 1 if a command misses the target")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runs:
        env = {**os.environ, "LMLAUNCH_RUNS_ROOT": runs}
        cli = lmlaunch_command()
        commands = {
            "python_pass": [sys.executable, "-c", "pass"],
            "dry_run": [*cli, "submit", "jobs/tiny-cpu.yaml", "--dry-run"],
            "validate": [*cli, "validate", "jobs/tiny-cpu.yaml"],
        }
        for cmd in commands.values():  # warm the page cache and .pyc files
            median_wall(cmd, 1, env)
        # Interleave rounds so that a burst of load elsewhere hits every command alike.
        rounds: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, cmd in commands.items():
                rounds[name].append(median_wall(cmd, 1, env))
    med = {name: statistics.median(ts) for name, ts in rounds.items()}
    base = med["python_pass"]
    result = {
        "bench": "cli_latency",
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "python_pass_s": round(base, 4),
        "dry_run_s": round(med["dry_run"], 4),
        "validate_s": round(med["validate"], 4),
        "dry_run_ratio": round(med["dry_run"] / base, 2),
        "validate_ratio": round(med["validate"] / base, 2),
        "target_s": TARGET_S,
        "dry_run_within_target": med["dry_run"] < TARGET_S,
        "validate_within_target": med["validate"] < TARGET_S,
    }
    print(json.dumps(result))
    ok = result["dry_run_within_target"] and result["validate_within_target"]
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
