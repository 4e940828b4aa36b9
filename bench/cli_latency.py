"""Wall time of `lmlaunch submit jobs/tiny-cpu.yaml --dry-run` and `lmlaunch validate`
against a bare `python -c pass` measured in the same run (same interpreter, same machine
load). Prints one JSON line: medians in seconds, ratios to the baseline, and whether each
command is under the 0.5 s target.

    python bench/cli_latency.py [--repeat 9] [--strict]
    python bench/cli_latency.py --snapshot [--repeat 9]

--strict exits 1 when a command misses the target. --snapshot times instead the code snapshot's zip
that every submission writes (launcher.runs.snapshot.write_zip) with the bytecode cache warm
against every module compiled (the cache empty each time), in the same run.
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
    parser.add_argument("--snapshot", action="store_true", help="time the snapshot's zip, cached against compiled")
    args = parser.parse_args()
    if args.snapshot:
        print(json.dumps(snapshot_zip(args.repeat)))
        return 0
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


def snapshot_zip(repeat: int) -> dict[str, object]:
    """The submission's zip of the code (launcher.runs.snapshot.write_zip): every module compiled (an
    empty cache each round: the baseline) against compiled once and reused (a warm cache), rounds
    interleaved."""
    sys.path[:0] = [str(REPO), str(REPO / "src")]
    from launcher.runs import snapshot

    _, files = snapshot.current()
    cold: list[float] = []
    warm: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        kept = Path(tmp) / "kept"
        snapshot.write_zip(Path(tmp) / "first.zip", files, Path(tmp) / "code", cache=kept)  # fills it
        for k in range(repeat):
            for times, cache in ((cold, Path(tmp) / f"empty-{k}"), (warm, kept)):
                start = time.perf_counter()
                snapshot.write_zip(Path(tmp) / "z.zip", files, Path(tmp) / "code", cache=cache)
                times.append(time.perf_counter() - start)
    compiled, cached = statistics.median(cold), statistics.median(warm)
    return {"bench": "snapshot_zip", "repeat": repeat, "modules": sum(r.endswith(".py") for r in files),
            "compiled_s": round(compiled, 4), "cached_s": round(cached, 4), "cached_over_compiled": round(cached / compiled, 3)}


if __name__ == "__main__":
    sys.exit(main())
