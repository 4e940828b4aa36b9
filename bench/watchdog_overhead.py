"""Cost of the hang watchdog on the training loop: ``ProgressWatchdog.beat()`` (called on every
batch) against an empty method call measured in the same run, plus the forced re-arm of the
C-level faulthandler timer (which ``beat`` does at most once a second). Prints JSON.

    python bench/watchdog_overhead.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from lmtrain.health.watchdog import ProgressWatchdog


class _Empty:
    def beat(self, step: int | None = None) -> None:
        pass


def _per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        wd = ProgressWatchdog(timeout_s=600, stacks_file=Path(d) / "s.txt", marker_file=Path(d) / "m.json",
                              rank=0, attempt=1, exit=False)
        wd.start()
        empty = _per_call(_Empty().beat, args.calls)
        beat = _per_call(wd.beat, args.calls)
        rearm = _per_call(lambda i: wd._arm_backstop(force=True), 2000)
        wd.stop()
    print(json.dumps({
        "calls": args.calls,
        "empty_call_us": round(empty * 1e6, 3),
        "beat_us": round(beat * 1e6, 3),
        "ratio_beat_vs_empty_call": round(beat / empty, 1),
        "forced_rearm_us": round(rearm * 1e6, 1),
        "note": "beat re-arms the C timer at most once per second; a training step is >= milliseconds",
    }, indent=2))


if __name__ == "__main__":
    main()
