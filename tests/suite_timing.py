"""Where the suite's time goes: per test, wall time against the CPU time it used.

``pytest --timing-report FILE`` (off otherwise) appends one JSON line per test to FILE, with

- ``wall_s``: setup + call + teardown, as ``--durations`` counts them together;
- ``machine_cpu_s``: busy CPU seconds of the whole machine over that time (``/proc/stat``: user,
  nice, system, irq, softirq, steal). SLURM runs a test's jobs under slurmd, not under pytest, so
  only the machine's counters see their CPU; in a serial run (``-n 0``) nearly all of it is the
  test's own (the daemons idle at a few per mille of a core);
- ``own_cpu_s``: this process and the children it waited for (``os.times``), a lower bound that
  stays meaningful when workers run in parallel;
- ``worker``: the pytest-xdist worker (``-`` when serial); ``outcome``: passed, failed or skipped
  (its first failing phase).

At the end of the session the controller prints the totals and the slowest tests;
``python tests/suite_timing.py FILE [--top N] [--markdown] [--write-durations tests/durations.json]``
prints the same from the file (and writes the per-test seconds that order parallel runs).
``busy`` is the share of the wall time the machine's cores were computing
(``machine_cpu_s / (wall_s * cores)``): the rest is waiting (BeginTime, GraceTime, queueing,
sleeps, imports on idle cores), which is what running tests side by side reclaims.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal
_TICKS = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """Busy CPU seconds of all cores since boot."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / _TICKS


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Recorder:
    """A pytest plugin object: times every test's whole protocol and appends a line per test."""

    def __init__(self, path: Path, phase: str | None = None) -> None:
        self.path = path
        self.phase = phase or "-"
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = "failed"  # in any phase, teardown included
        elif report.when == "call" or report.skipped:
            self.outcomes.setdefault(report.nodeid, report.outcome)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start_wall, start_busy, start_own = time.monotonic(), machine_busy_seconds(), own_cpu_seconds()
        started = time.time()
        outcome = yield
        record = {
            "test": item.nodeid,
            "wall_s": round(time.monotonic() - start_wall, 3),
            "machine_cpu_s": round(machine_busy_seconds() - start_busy, 3),
            "own_cpu_s": round(own_cpu_seconds() - start_own, 3),
            "worker": self.worker,
            "phase": self.phase,
            "start": round(started, 1),
            "outcome": self.outcomes.pop(item.nodeid, "passed"),
        }
        with open(self.path, "a") as f:  # one short line per write: O_APPEND keeps workers' lines whole
            f.write(json.dumps(record) + "\n")
        return outcome


def read(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def summary(rows: list[dict], top: int = 30, markdown: bool = False, cores: int | None = None) -> str:
    cores = cores or os.cpu_count() or 1
    wall = sum(r["wall_s"] for r in rows)
    cpu = sum(r["machine_cpu_s"] for r in rows)
    own = sum(r["own_cpu_s"] for r in rows)
    lines = [
        f"{len(rows)} tests: {wall / 60:.1f} min of test wall time (summed over workers), "
        f"{cpu / 60:.1f} min of machine CPU ({cpu / max(wall, 1e-9) / cores:.0%} of {cores} cores busy), "
        f"{own / 60:.1f} min in pytest and its children",
    ]
    phases: dict[str, list[float]] = {}  # phase -> first start, last end, tests (reports since "start")
    for r in rows:
        if "start" in r:
            span = phases.setdefault(r.get("phase", "-"), [r["start"], 0.0, 0])
            span[0], span[1], span[2] = min(span[0], r["start"]), max(span[1], r["start"] + r["wall_s"]), span[2] + 1
    if phases:
        t0 = min(v[0] for v in phases.values())
        lines.append("phases (from the first test's start): " + "; ".join(
            f"{name} {(a - t0) / 60:.1f}-{(b - t0) / 60:.1f} min ({n} tests)"
            for name, (a, b, n) in sorted(phases.items(), key=lambda kv: kv[1][0])))
    modules: dict[str, list[float]] = {}
    for r in rows:
        m = modules.setdefault(r["test"].split("::")[0], [0.0, 0.0, 0])
        m[0] += r["wall_s"]
        m[1] += r["machine_cpu_s"]
        m[2] += 1
    heavy = sorted(modules.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    if markdown:
        lines += ["", "| module | tests | wall s | machine CPU s | busy |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{m}` | {n} | {w:.0f} | {c:.0f} | {c / max(w, 1e-9) / cores:.0%} |" for m, (w, c, n) in heavy]
    else:
        lines.append(f"longest {len(heavy)} modules: wall s, machine CPU s, tests")
        lines += [f"{w:8.1f} {c:8.1f} {n:5d}  {m}" for m, (w, c, n) in heavy]
    slow = sorted(rows, key=lambda r: r["wall_s"], reverse=True)[:top]
    if markdown:
        lines += ["", "| # | test | wall s | machine CPU s | busy | worker |", "| --- | --- | --- | --- | --- | --- |"]
    else:
        lines.append(f"slowest {len(slow)}: wall s, machine CPU s, busy share of {cores} cores")
    for i, r in enumerate(slow, 1):
        busy = r["machine_cpu_s"] / max(r["wall_s"], 1e-9) / cores
        if markdown:
            lines.append(f"| {i} | `{r['test']}` | {r['wall_s']:.1f} | {r['machine_cpu_s']:.1f} | {busy:.0%} | {r['worker']} |")
        else:
            lines.append(f"{r['wall_s']:8.1f} {r['machine_cpu_s']:8.1f} {busy:5.0%}  {r['test']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--cores", type=int, default=None)
    p.add_argument("--write-durations", type=Path, metavar="JSON",
                   help="write each test's wall seconds to JSON (tests/durations.json orders parallel runs)")
    args = p.parse_args(argv)
    rows = read(args.file)
    print(summary(rows, args.top, args.markdown, args.cores))
    if args.write_durations:
        durations: dict[str, float] = {}  # a test's first report, its phase-3 rerun on the other SLURM not
        for r in sorted(rows, key=lambda r: r.get("phase") == "other-slurm"):
            durations.setdefault(r["test"], round(r["wall_s"], 1))
        args.write_durations.write_text(json.dumps(dict(sorted(durations.items())), indent=0) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
