"""How the suite hands tests to its xdist workers (tests/scheduling.py), driven through xdist's own
scheduler interface with workers that take simulated time: every test runs once, a worker never
holds a long test behind another while shorter ones wait, and phase 3's tests (their seconds in a
fresh-clone run) end sooner than under xdist's load scheduling."""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

from xdist.scheduler import LoadScheduling

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scheduling import LongestFirst

# Phase 3 of fresh-clone run P (docs/testing.md): the 16 both_versions tests on SLURM 24.11, seconds.
PHASE_3 = [129.5, 110.0, 98.5, 80.8, 44.1, 41.0, 36.8, 30.5, 22.5, 22.0, 18.8, 16.9, 16.9, 13.3, 12.3, 10.5]


class Config:
    def __init__(self, workers: int) -> None:
        self.workers = workers

    def getvalue(self, name: str):
        return ["popen"] * self.workers if name == "tx" else None

    def getoption(self, name: str, default=None):
        return {"maxschedchunk": None, "numprocesses": self.workers, "dist": "load"}.get(name, default)


class Gateway:
    def __init__(self, name: str) -> None:
        self.id = name


class Worker:
    """An xdist worker as the scheduler sees it: it is sent tests and told to shut down."""

    def __init__(self, name: str) -> None:
        self.gateway = Gateway(name)
        self.shutting_down = False
        self.held: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.held.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def run(sched: LoadScheduling, seconds: list[float], workers: int) -> tuple[float, list[int], list[tuple[int, int]]]:
    """Drive ``sched`` as xdist's controller does, a worker running the first test it holds once it
    holds a second one (or is shutting down). Returns the makespan, the tests run in order, and
    every (running, held) pair of tests at the moment one started."""
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    names = [f"t{i}" for i in range(len(seconds))]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, names)
    sched.schedule()
    events: list[tuple[float, int, int]] = []  # (end time, node, test)
    busy = [False] * workers
    ran: list[int] = []
    pairs: list[tuple[int, int]] = []
    now = 0.0

    def start_ready() -> None:
        for n, node in enumerate(nodes):
            if not busy[n] and node.held and (len(node.held) >= 2 or node.shutting_down):
                test = node.held.pop(0)
                if node.held:
                    pairs.append((test, node.held[0]))
                busy[n] = True
                heapq.heappush(events, (now + seconds[test], n, test))

    start_ready()
    while events:
        now, n, test = heapq.heappop(events)
        busy[n] = False
        ran.append(test)
        sched.mark_test_complete(nodes[n], test, seconds[test])
        start_ready()
    assert all(not node.held for node in nodes), "a worker was left holding a test"
    return now, ran, pairs


def test_every_test_runs_once_and_no_long_test_is_held_behind_another():
    seconds = [300.0, 140.0, 130.0, 120.0, 90.0, *[20.0] * 10, *[0.5] * 60, *[0.01] * 200]
    span, ran, pairs = run(LongestFirst(Config(4), seconds=dict(zip([f"t{i}" for i in range(len(seconds))], seconds)),
                                        unknown_s=2.0), seconds, 4)
    assert sorted(ran) == list(range(len(seconds)))
    long_behind_long = [(a, b) for a, b in pairs if seconds[a] >= 20 and seconds[b] >= 20]
    assert not long_behind_long
    assert span <= 300.0 + 1.0  # the longest test bounds it: everything else fits beside it


def test_phase_three_ends_sooner_than_under_xdists_load_scheduling():
    names = {f"t{i}": s for i, s in enumerate(PHASE_3)}
    ours, ran, _ = run(LongestFirst(Config(4), seconds=names, unknown_s=2.0), PHASE_3, 4)
    theirs, ran_theirs, _ = run(LoadScheduling(Config(4)), PHASE_3, 4)
    assert sorted(ran) == sorted(ran_theirs) == list(range(len(PHASE_3)))
    print(f"phase 3 on 4 workers: {ours:.0f} s (longest first), {theirs:.0f} s (xdist's load)")
    assert ours <= 0.85 * theirs
    assert ours <= sum(PHASE_3) / 4 * 1.15  # within 15 % of a perfect split


def test_fewer_tests_than_workers_all_run():
    seconds = [5.0, 1.0, 3.0]
    names = {f"t{i}": s for i, s in enumerate(seconds)}
    _, ran, _ = run(LongestFirst(Config(4), seconds=names, unknown_s=2.0), seconds, 4)
    assert sorted(ran) == [0, 1, 2]
