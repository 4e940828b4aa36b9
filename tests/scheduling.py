"""How a parallel run hands tests to its xdist workers: the longest first, never one behind another.

An xdist worker runs a test only once it holds the next one too (pytest needs the next item to
know which fixtures to tear down), so each worker always has one test running and one committed
behind it. xdist's load scheduling hands out consecutive tests: with the longest first, a worker
got the two longest tests and ran them one after the other while others went idle (phase 3, 16
cluster tests on 4 workers: 225 s where 180 would do). Here a worker that starts a long test is
given the shortest test left to hold behind it, and one that starts a short test is given the
longest left, so that every long test starts as soon as a worker is free.

The seconds are tests/durations.json's; the collection comes ordered by them (tests/conftest.py:
long tests one by one, the short ones module by module, so that a module's fixtures are set up
once per worker where they can be), and the shortest are taken from its end.
"""

from __future__ import annotations

from xdist.scheduler import LoadScheduling


class LongestFirst(LoadScheduling):
    """xdist's load scheduling, with the test held behind a running one chosen by length."""

    def __init__(self, config, log=None, *, seconds: dict[str, float], unknown_s: float) -> None:
        super().__init__(config, log)
        self._seconds = seconds
        self._unknown_s = unknown_s

    def _length(self, index: int) -> float:
        assert self.collection is not None
        return self._seconds.get(self.collection[index], self._unknown_s)

    def _send(self, node, index: int) -> None:
        self.pending.remove(index)
        self.node2pending[node].append(index)
        node.send_runtest_some([index])

    def _next_for(self, node) -> None:
        """Give ``node`` a test to hold behind the one it is starting (the one it holds)."""
        held = self.node2pending[node]
        if len(self.pending) > 1 and held and self._length(held[0]) >= 0.5 * self._length(self.pending[0]):
            self._send(node, self.pending[-1])  # a long test starts: the shortest waits behind it
        else:
            self._send(node, self.pending[0])

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:  # the first distribution is done: a node was added
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        self.pending[:] = range(len(self.collection))  # conftest's order: longest first, short modules together
        for node in self.nodes:
            self.check_schedule(node)
        if not self.pending:
            for node in self.nodes:
                node.shutdown()

    def check_schedule(self, node, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if not self.pending:
            node.shutdown()  # the node runs what it holds, then stops
            return
        while self.pending and len(self.node2pending[node]) < 2:
            if self.node2pending[node]:
                self._next_for(node)
            else:
                self._send(node, self.pending[0])
        if not self.pending:
            node.shutdown()
        self.log("num items waiting for node:", len(self.pending))
