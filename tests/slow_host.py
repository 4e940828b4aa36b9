"""The slow-host stress mode: make this machine behave like a host whose task imports take
``--target`` seconds (about 6; CI's slowest hosts of this kind took 6.7 CPU-s where a fast one
takes 2.6), so that the whole suite can be run as it would run there.

A slower CPU makes every thread slower, whatever else runs. CPU burners beside the suite come
closest when each core has one burner pinned to it whose scheduling weight (its nice value) gives a
thread of the suite on that core the share ``quiet / target`` of the core: the kernel's fair
scheduler splits a core between its runnable threads by weight, so one thread of the suite beside
a burner of weight ``w`` runs ``1024 / (1024 + w)`` of the time. A host already as slow as the
target gets no burner. What this cannot copy: where the suite runs two threads on one core they
share it with the burner, so they lose a little less than on a slower CPU (each gets
``1024 / (2048 + w)`` instead of half the slower core's).

    python tests/slow_host.py --quiet 2.6 [--target 6.0]

starts the burners (in a session of their own, so they outlive this process), then measures a
task's imports under them (``bench/task_imports.py``'s imports, wall-clock seconds of one fresh
interpreter) and prints one JSON line: ``{"pids": [...], "nice": N, "share": S, "imports_s": X}``.
``scripts/test.sh`` (``LMLAUNCH_TEST_STRESS=slow``) kills the burners when the suite ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

# The kernel's weight of each nice value, -20 .. 19 (kernel/sched/core.c: sched_prio_to_weight).
NICE_WEIGHTS = (
    88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
    9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
)
NICE_0 = 1024


def burner_nice(quiet: float, target: float) -> int | None:
    """The nice value whose weight leaves a thread beside it about ``quiet / target`` of a core:
    None when the host is as slow as the target already."""
    if quiet <= 0 or target <= quiet * 1.05:
        return None
    wanted = NICE_0 * (target / quiet - 1.0)
    best = min(range(len(NICE_WEIGHTS)), key=lambda i: abs(NICE_WEIGHTS[i] - wanted))
    return best - 20


def share(nice: int | None) -> float:
    """The share of a core one thread of the suite gets beside a burner of ``nice``."""
    return 1.0 if nice is None else NICE_0 / (NICE_0 + NICE_WEIGHTS[nice + 20])


def _autogroup_nice(nice: int) -> None:
    """This process's autogroup at ``nice``. With the kernel's autogroups (sched_autogroup_enabled:
    Debian's default) the fair scheduler splits a core between sessions first, by each autogroup's
    nice, and only then between a session's threads by theirs: a burner in a session of its own at
    process nice 8 still took 68 % of its core beside the suite (a task's imports 13.1 s against the
    6 asked, R64's first start). Without autogroups there is no such file: the process's nice is the
    weight. A second write within 100 ms is refused (EAGAIN) to a process without CAP_SYS_ADMIN."""
    for _ in range(20):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return
        except BlockingIOError:
            time.sleep(0.1)
        except OSError:
            return


def start_burners(nice: int, cores: list[int]) -> list[int]:
    """One busy loop pinned to each core, at ``nice``, in a session of its own (whose autogroup, when
    the kernel has them, gets ``nice`` too)."""
    pids = []
    for core in cores:
        def pin(core: int = core) -> None:
            os.sched_setaffinity(0, {core})
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            _autogroup_nice(nice)
        proc = subprocess.Popen(["sh", "-c", "while :; do :; done"], preexec_fn=pin, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids.append(proc.pid)
    return pids


def imports_wall_s() -> float:
    """Wall-clock seconds of one task's imports in a fresh interpreter (collector paused), as
    bench/task_imports.py runs them."""
    import task_imports

    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", task_imports.PAUSED], env=env, check=True)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quiet", type=float, required=True, help="a task's imports on this host, quiet (CPU-s)")
    ap.add_argument("--target", type=float, default=6.0, help="a task's imports on the host to copy (s)")
    args = ap.parse_args(argv)
    nice = burner_nice(args.quiet, args.target)
    cores = sorted(os.sched_getaffinity(0))
    pids = start_burners(nice, cores) if nice is not None else []
    try:
        measured = imports_wall_s()
    except BaseException:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        raise
    print(json.dumps({"pids": pids, "nice": nice, "cores": cores, "share": round(share(nice), 3),
                      "quiet_cpu_s": args.quiet, "target_s": args.target, "imports_s": round(measured, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
