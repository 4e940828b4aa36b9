"""Rank 0's straggler watch: the ranks' timing files scored in the background, findings recorded.

At each of its logging steps rank 0 pokes a thread (no collective, nothing in the training loop
but the poke). The thread reads what every rank appended to its node's ``logs/attempt-<N>/timing-node-<N>.jsonl``
since it last looked (lmtrain.observe.rank_timing), keeps the last intervals as a table (rows:
logging steps, columns: ranks), scores it (:func:`lmtrain.health.stragglers.score`) and, when the
set of slow ranks changes, writes a ``straggler`` ledger line per change (``state`` ``start`` with
the rank, its node, the factor and what it was compared with; ``end`` when it is no longer slow),
logs it in rank 0's log and sends the ``straggler`` webhook event. ``lmlaunch status`` shows the
ranks slow now from those lines (launcher.monitor.status_rows).

Logging intervals shorter than ``health.stragglers.min_interval_s`` are summed into one scored
interval (:class:`TimingTable`): a rank descheduled for a moment is not a straggler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lmcore.atomic import write_json
from lmcore.run.rundir import LedgerNote
from lmcore.run.straggler_lines import describe
from lmtrain.health.stragglers import Slow, StragglerPolicy, line_figures, others_median, score
from lmtrain.observe.timing_lines import PARTS, read_timing

log = logging.getLogger(__name__)

KEEP_INTERVALS = 64  # scored intervals kept: the window and each rank's own history before it
LATE_ROWS = 3  # newer rows after which a row with a rank's line missing is scored without it


class TimingTable:
    """The ranks' compute per step by scored interval, from their timing files (read incrementally).

    Logging intervals arrive as rows (one per logging step, a cell per rank); consecutive rows are
    summed into one scored interval once their wall time (the ranks' median) reaches
    ``min_interval_s``. A row is folded once every rank wrote it, or once LATE_ROWS newer rows
    exist (a rank that never writes one is missing there, never slow for it); rows fold in order."""

    def __init__(self, paths: list[Path], *, world: int | None = None, min_interval_s: float = 0.0) -> None:
        # paths: the nodes' timing files (or one per rank); world: the ranks (default: one per path)
        self.paths, self.min_interval_s = paths, min_interval_s
        self.world = len(paths) if world is None else world
        self.offsets = [0] * len(paths)
        self.rows: dict[int, np.ndarray] = {}  # step -> [forward_s, steps, wall_s] x ranks
        self.intervals: list[np.ndarray] = []
        self.last_step: int | None = None  # the newest step folded into an interval
        self.nodes: dict[int, str] = {}
        self.newest: dict[int, dict[str, Any]] = {}  # rank -> its newest line

    def read(self) -> None:
        world = self.world
        for i, path in enumerate(self.paths):
            lines, self.offsets[i] = read_timing(path, self.offsets[i])
            for line in lines:
                step, rank = int(line.get("step", -1)), int(line.get("rank", i))
                if step < 0 or not 0 <= rank < world or (self.last_step is not None and step <= self.last_step):
                    continue
                row = self.rows.setdefault(step, np.full((3, world), np.nan))
                row[:, rank] = line_figures(line)
                self.nodes[rank] = str(line.get("node") or "?")
                self.newest[rank] = line
        self._fold()

    def _fold(self) -> None:
        every = sorted(self.rows)
        steps = []
        for i, step in enumerate(every):
            # a row waits for every rank's line until LATE_ROWS newer rows exist (another node's
            # lines may show late on a shared filesystem); rows fold in order
            if np.isnan(self.rows[step][0]).any() and len(every) - 1 - i < LATE_ROWS:
                break
            steps.append(step)
        taken: list[int] = []
        wall = 0.0
        for step in steps:
            taken.append(step)
            wall += float(np.nanmedian(self.rows[step][2]))
            if wall >= self.min_interval_s:
                summed = np.nansum([self.rows[s] for s in taken], axis=0)
                seen = ~np.all(np.isnan([self.rows[s][0] for s in taken]), axis=0)
                with np.errstate(invalid="ignore", divide="ignore"):
                    self.intervals.append(np.where(seen, summed[0] / summed[1], np.nan))
                for s in taken:
                    del self.rows[s]
                self.last_step, taken, wall = step, [], 0.0
        del self.intervals[:-KEEP_INTERVALS]

    def table(self) -> np.ndarray:
        """The scored intervals, oldest first: ``[interval, rank]`` compute seconds per step."""
        if not self.intervals:
            return np.empty((0, self.world))
        return np.vstack(self.intervals)


def watch_for(plan: Any, env: Any, records: Any, peers: list[list[int]],
              leave_slow_node: Callable[[dict[str, Any], str], None]) -> StragglerWatch | None:
    """Rank 0 of a job of 2+ ranks: the attempt's straggler watch, started (None elsewhere, or when the
    spec turned it off). ``records``: the attempt's lmtrain.observe.attempt.AttemptRecords; ``peers``:
    the ranks that do the same work; ``leave_slow_node``: what ``health.stragglers.action: exclude``
    calls. Lightning's ranks (lmtrain.task.fit) and the scale harness's (lmtrain.simulate) both start it here."""
    from lmcore.run.rundir import RunLayout

    spec = plan.job_spec().health.stragglers
    if env.rank != 0 or env.world_size <= 1 or not spec.enabled:
        return None
    layout, attempt, notifier = RunLayout.of_plan(plan), records.attempt, records.notifier
    return StragglerWatch([layout.node_timing(attempt, n) for n in range(env.num_nodes)],
                          StragglerPolicy(threshold=spec.threshold, window=spec.window), attempt=attempt,
                          world=env.world_size,
                          ledger=records.ledger, min_interval_s=spec.min_interval_s,
                          summary=layout.rank_times, peers=peers,
                          notify=notifier.send if notifier is not None else None,
                          on_slow=leave_slow_node if spec.action == "exclude" else None).start()


class StragglerWatch:
    """Rank 0: scores the ranks' timing in a thread woken at logging steps; records what changes."""

    def __init__(self, paths: list[Path], policy: StragglerPolicy, *, attempt: int, ledger: Any,
                 notify: Callable[..., None] | None = None, min_interval_s: float = 0.0,
                 summary: Path | None = None, peers: list[list[int]] | None = None,
                 on_slow: Callable[[dict[str, Any], str], None] | None = None, world: int | None = None) -> None:
        self.table = TimingTable(paths, world=world, min_interval_s=min_interval_s)
        # ranks that do the same work, compared with each other (a pipeline's stages differ by design)
        self.peers = peers or [list(range(self.table.world))]
        self.summary = summary  # metrics/rank-times.json: what the exporter shows per rank
        self.policy, self.attempt, self.ledger, self.notify = policy, attempt, ledger, notify
        self.on_slow = on_slow  # health.stragglers.action exclude: the controller leaves the node out
        self.slow: dict[int, Slow] = {}
        self._wake = threading.Event()
        self._looking = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmtrain-straggler-watch", daemon=True)

    def start(self) -> StragglerWatch:
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """At the fit's end: the thread stops, then one last look at the rows the ranks wrote (not
        while the thread is still in one: a slow filesystem; never raising: the run is done)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            return
        try:
            self.look()
        except Exception:
            log.exception("straggler watch: the last look failed")

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                self.look()
            except Exception:  # the watch never costs the run
                log.exception("straggler watch: scoring failed; training goes on")

    def look(self) -> list[dict[str, Any]]:
        """Read, score, record the changes; the ledger lines written (one look at a time)."""
        with self._looking:
            return self._look()

    def _look(self) -> list[dict[str, Any]]:
        self.table.read()
        step = self.table.last_step
        table = self.table.table()
        now = {group[s.rank]: replace(s, rank=group[s.rank]) for group in self.peers
               for s in score(table[:, group], self.policy)}
        lines = []
        for rank in sorted(set(now) | set(self.slow)):
            before, after = self.slow.get(rank), now.get(rank)
            if after is not None and before is None:
                lines.append(self._record("start", after, step))
            elif after is None and before is not None:
                lines.append(self._record("end", before, step))
        self.slow = now
        if self.summary is not None:
            self._write_summary(self.summary, step)
        return lines

    def _write_summary(self, path: Path, step: int | None) -> None:
        """Every rank's newest seconds per step by part, and the slow ranks: one small file the
        exporter reads per scrape instead of every rank's."""
        table = self.table.table()
        ratio = table[-1] / others_median(table[-1]) if len(table) else None  # the newest scored interval
        ranks = {}
        for rank, line in sorted(self.table.newest.items()):
            steps = max(int(line.get("steps") or 1), 1)
            vs_peers = None if ratio is None or not np.isfinite(ratio[rank]) else round(float(ratio[rank]), 3)
            ranks[str(rank)] = {"node": line.get("node"), "step": line.get("step"), "vs_peers": vs_peers,
                                "slow": rank in self.slow,
                                **{part: float(line.get(f"{part}_s") or 0.0) / steps for part in PARTS}}
        slow = [{"rank": s.rank, "node": self.table.nodes.get(s.rank, "?"), "factor": s.factor, "against": s.against}
                for s in self.slow.values()]
        try:
            write_json(path, {"attempt": self.attempt, "step": step, "time": time.time(), "ranks": ranks,
                                      "slow": slow})
        except OSError as exc:
            log.warning("could not write the ranks' timing summary: %s", exc)

    def _record(self, state: str, slow: Slow, step: int | None) -> dict[str, Any]:
        node = self.table.nodes.get(slow.rank, "?")
        fields = {"attempt": self.attempt, "state": state, "rank": slow.rank, "node": node, "factor": slow.factor,
                  "against": slow.against, "step": step}
        text = describe(fields)
        if state == "start":
            log.warning("straggler: %s (health.stragglers: above %.2gx in %d scored intervals in a row, each at "
                        "least %.0f s)", text, self.policy.threshold, self.policy.window, self.table.min_interval_s)
        else:
            log.info("straggler no longer: rank %d (%s) from step %s", slow.rank, node, step)
        try:
            self.ledger.write(LedgerNote(event="straggler", time=time.time(), fields=fields))
        except OSError as exc:
            log.warning("could not record the straggler in the ledger: %s", exc)
        if self.notify is not None:
            self.notify("straggler", text if state == "start" else f"rank {slow.rank} ({node}) is no longer slow",
                        **fields)
        if state == "start" and self.on_slow is not None:
            self.on_slow(fields, text)
        return fields
