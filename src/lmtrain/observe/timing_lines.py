"""A rank's step-timing lines (torch-free): the writer and the reader of ``timing-node-<N>.jsonl``.

Every rank of a node appends its lines to the node's one file (opened with O_APPEND: each line one
write by one process of that node, so lines never interleave within a line), so an attempt creates a
timing file per node, not per rank, and rank 0's straggler watch opens one per node at each look.

:class:`lmtrain.observe.rank_timing.RankTiming` times a Lightning rank's micro batches and hands each
logging interval's totals to :class:`TimingLines`; the scale harness (lmtrain.simulate) hands its own.
Rank 0's straggler watch (lmtrain.health.straggler_watch) reads them with :func:`read_timing`. Line
format: docs/run-directory.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcore.run.straggler_lines import TIMING_PARTS

log = logging.getLogger(__name__)

PARTS = TIMING_PARTS  # data, forward, backward, optimizer, boundary


class TimingLines:
    """Appends one line per logging interval; the file is opened at the first line and kept open."""

    def __init__(self, path: str | Path, *, rank: int, node: str,
                 after_write: Callable[[], None] | None = None, on_close: Callable[[], None] | None = None) -> None:
        self.path, self.rank, self.node = Path(path), rank, node
        self.after_write, self.on_close = after_write, on_close  # rank 0: its straggler watch's poke and stop
        self._fd: int | None = None

    def open(self) -> None:
        """Open (and create) the node's file now rather than at the first line."""
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, step: int, *, steps: int, micro_batches: int, totals: dict[str, float], wall_s: float) -> None:
        line = {"step": step, "steps": steps, "micro_batches": micro_batches, "rank": self.rank,
                "node": self.node, "t": round(time.time(), 3),
                **{f"{part}_s": round(totals.get(part, 0.0), 6) for part in PARTS},
                "wall_s": round(wall_s, 6)}
        try:
            self.open()
            assert self._fd is not None
            os.write(self._fd, (json.dumps(line) + "\n").encode())  # one write: the node's other ranks append too
        except OSError as exc:  # timing never costs the run
            log.warning("could not write this rank's step timing to %s: %s", self.path, exc)
        if self.after_write is not None:
            self.after_write()

    def close(self) -> None:
        """The file closed and rank 0's watch stopped; never raising (the run's outcome is not ours)."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError as exc:
                log.warning("closing this rank's step timing %s: %s", self.path, exc)
            self._fd = None
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            try:
                on_close()
            except Exception:
                log.exception("stopping the straggler watch failed")


def read_timing(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The whole lines of a timing file from ``offset`` on, and the offset after the last whole line
    (a line being written is read next time)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:  # not there yet, or the filesystem said no this time: asked again next look
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = []
    for raw in data[:end].splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines, offset + end
