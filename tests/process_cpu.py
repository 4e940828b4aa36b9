"""Where a test run's CPU went, process by process: a summary of BSD process accounting.

The timing report (tests/suite_timing.py) sees the machine's CPU per test; it cannot say which
processes spent it, and SLURM's tasks are not the test's children. The kernel's process accounting
records every process at its exit (command, CPU, pid, parent): this groups them into SLURM tasks
(Python under slurmstepd), Python children of Python (pytest workers, the zygotes and their forked
ranks, subprocesses), mypy, the compiler and the rest. A parent is found by its pid among the
recorded processes, and pids are reused: the small groups (python under git, under scontrol) are
approximate, the large ones are not.

    apt-get install acct                                # Debian's process accounting tools
    touch /tmp/pacct && accton /tmp/pacct               # from here on every exit is recorded
    CI=true bash .ci/run; accton off
    python tests/process_cpu.py /tmp/pacct              # reads it through dump-acct
"""

from __future__ import annotations

import argparse
import subprocess
from collections import Counter
from dataclasses import dataclass

TICKS = 100  # dump-acct prints CPU in AHZ ticks: 100 per second on Linux


@dataclass(frozen=True)
class Proc:
    comm: str
    cpu_s: float
    pid: int
    ppid: int


def read(path: str) -> list[Proc]:
    text = subprocess.run(["dump-acct", path], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) >= 11:
            out.append(Proc(f[0], (float(f[2]) + float(f[3])) / TICKS, int(f[9]), int(f[10])))
    return out


def summary(procs: list[Proc]) -> str:
    by_pid = {p.pid: p for p in procs}

    def parent(p: Proc) -> str:
        return by_pid[p.ppid].comm if p.ppid in by_pid else "?"

    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for p in procs:
        if p.comm == "python" and parent(p) == "slurmstepd":
            key = "SLURM tasks (python under slurmstepd)"
        elif p.comm == "python" and parent(p) == "python":
            key = ("python children of python, >= 3 CPU-s (a fresh interpreter's imports)" if p.cpu_s >= 3
                   else "python children of python, < 3 CPU-s (forked ranks, helpers)")
        elif p.comm == "python":
            key = f"python under {parent(p)}"
        else:
            key = p.comm
        groups[key] += p.cpu_s
        counts[key] += 1
    total = sum(groups.values())
    lines = [f"{total / 60:.1f} CPU-min in {len(procs)} processes"]
    for key, cpu in groups.most_common(12):
        lines.append(f"  {cpu / 60:7.2f} CPU-min  {counts[key]:6d}  {key}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pacct", help="the process accounting file accton wrote")
    args = ap.parse_args(argv)
    print(summary(read(args.pacct)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
