"""Per-rank step timing: where each rank's step goes, written per logging interval.

Every rank times the parts of its micro batches that differ between ranks and appends one line
per logging interval to its node's ``logs/attempt-<N>/timing-node-<N>.jsonl`` (lmcore.run.run_layout), with its
node. No collective, no host sync: host clocks between Lightning's hooks on CPU; on a GPU, CUDA
events recorded at the same hooks and read at logging steps only (the event of the interval's
last part is waited for then, when the logging step reads the loss anyway).

The parts of a micro batch, between Lightning's hooks (``RankTiming`` is the first callback and
``BoundaryMark`` the last, so the other callbacks' work lands in ``boundary``):

- ``data``: from the previous batch's boundary to this batch's start (the loader, the copy to
  the device; also the LightningModule's own batch-end work, where a logging step reduces the loss
  over the ranks, and a validation pass run in between);
- ``forward``: ``training_step`` (forward and loss). No collective under DDP, so this is the
  compute :mod:`lmtrain.health.stragglers` compares; under FSDP and ZeRO-3 it includes the
  parameter gathers, where a slow rank's peers wait too (the factor then understates);
- ``backward``: includes the gradient reduction, where fast ranks wait for the slowest;
- ``optimizer``: the optimizer step (and clipping) at an accumulation boundary;
- ``boundary``: the other callbacks at the batch's end: the stop agreement's all-reduce (fast
  ranks wait there), a checkpoint's stall, the heartbeat.

Line format (docs/run-directory.md): ``{"step", "steps", "micro_batches", "rank", "node", "t",
"data_s", "forward_s", "backward_s", "optimizer_s", "boundary_s", "wall_s"}``, seconds summed over
the interval; ``wall_s`` is the interval's wall time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lmtrain.observe.timing_lines import PARTS, TimingLines, read_timing

log = logging.getLogger(__name__)

__all__ = ["PARTS", "BoundaryMark", "RankTiming", "read_timing"]


class _HostClock:
    """CPU: a part's time is the host's."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)
        self._open: dict[str, float] = {}

    def start(self, part: str) -> None:
        self._open[part] = time.perf_counter()

    def stop(self, part: str) -> None:
        began = self._open.pop(part, None)
        if began is not None:
            self.totals[part] += time.perf_counter() - began

    def drain(self) -> None:
        """Nothing waits on the host's clock."""

    def read(self) -> dict[str, float]:
        out, self.totals = self.totals, dict.fromkeys(PARTS, 0.0)
        return out


class _CudaClock(_HostClock):
    """GPU: forward, backward and optimizer by CUDA events (the device's time, read at logging steps
    only); data and boundary by the host (waits the device does not see)."""

    DEVICE_PARTS = ("forward", "backward", "optimizer")

    def __init__(self) -> None:
        super().__init__()
        self._events: list[tuple[str, Any, Any]] = []
        self._began: dict[str, Any] = {}

    def start(self, part: str) -> None:
        if part not in self.DEVICE_PARTS:
            return super().start(part)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._began[part] = event

    def stop(self, part: str) -> None:
        if part not in self.DEVICE_PARTS:
            return super().stop(part)
        began = self._began.pop(part, None)
        if began is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((part, began, end))

    def drain(self) -> None:
        """Adds the parts the device has finished (non-blocking): the list stays short between
        logging steps however far apart they are."""
        done = 0
        for part, began, end in self._events:
            if not end.query():
                break
            self.totals[part] += began.elapsed_time(end) / 1000.0
            done += 1
        del self._events[:done]

    def read(self) -> dict[str, float]:
        if self._events:
            self._events[-1][2].synchronize()  # the logging step: its loss read waits for as much
        self.drain()
        return super().read()


class RankTiming(pl.Callback):
    """Times this rank's micro batches (first in the Trainer's callbacks) and writes a line per
    logging interval. ``BoundaryMark`` (last in the callbacks) closes each batch's boundary."""

    def __init__(self, path: str | Path, *, rank: int, node: str, log_every_n_steps: int, cuda: bool,
                 after_write: Callable[[], None] | None = None, on_close: Callable[[], None] | None = None) -> None:
        self.path, self.rank, self.node, self.every = Path(path), rank, node, log_every_n_steps
        self.lines = TimingLines(path, rank=rank, node=node, after_write=after_write, on_close=on_close)
        self.clock: _HostClock = _CudaClock() if cuda else _HostClock()
        self.micro_batches = 0
        self._last_step: int | None = None
        self._interval_began: float | None = None

    def boundary_mark(self) -> BoundaryMark:
        return BoundaryMark(self)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._interval_began = time.perf_counter()
        self.clock.start("data")  # the first batch's wait for the loader

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.clock.stop("data")
        self.clock.start("forward")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.clock.stop("forward")
        self.clock.start("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.stop("backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.clock.start("optimizer")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.clock.stop("forward")  # a step whose loss was not finite skips backward (DeepSpeed's overflow)
        self.clock.stop("optimizer")
        self.micro_batches += 1
        self.clock.start("boundary")

    def close_boundary(self, trainer: pl.Trainer) -> None:
        """The batch's boundary ends (``BoundaryMark``, after every other callback): on a logging
        step, this interval's line."""
        self.clock.stop("boundary")
        self.clock.drain()
        step = trainer.global_step
        if self._last_step is not None and step > self._last_step and (step % self.every == 0 or step == trainer.max_steps):
            self._write(step)
        self.clock.start("data")

    def _write(self, step: int) -> None:
        now = time.perf_counter()
        assert self._last_step is not None and self._interval_began is not None
        steps, micro_batches, wall_s = step - self._last_step, self.micro_batches, now - self._interval_began
        self._last_step, self._interval_began, self.micro_batches = step, now, 0
        self.lines.write(step, steps=steps, micro_batches=micro_batches, totals=self.clock.read(), wall_s=wall_s)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # the fit raised: Lightning runs no teardown of callbacks then

    def _close(self) -> None:
        self.lines.close()


class BoundaryMark(pl.Callback):
    """The last of the Trainer's callbacks: ends the batch's boundary part of :class:`RankTiming`."""

    def __init__(self, timing: RankTiming) -> None:
        self.timing = timing

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.timing.close_boundary(trainer)
