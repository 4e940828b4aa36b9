"""The checkpoint callback: saves every ``checkpoint.every_n_steps`` and at the end of training
through :class:`lmtrain.checkpoint.manager.CheckpointManager`, reports each save in the
heartbeat, and restores this rank's RNG streams and data position on resume."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lmcore.run.checkpoint_index import step_of
from lmcore.run.rundir import Heartbeat
from lmtrain import faults
from lmtrain.checkpoint.disk_space import DiskFull
from lmtrain.checkpoint.manager import CheckpointManager
from lmtrain.checkpoint.rng_state import capture_rng, restore_rng

log = logging.getLogger("lmtrain.observe.callbacks")


class CheckpointCallback(pl.Callback):
    """Periodic and final checkpoints (collective), and exact restoration of per-rank RNG state.

    ``rank_state`` returns what each rank saves besides Lightning's checkpoint (data position, loss window);
    RNG states are added here. On resume the saved RNG state is restored at the start of the
    first training batch, after everything that may draw random numbers while the fit starts
    (DataLoader iterator creation, validation) has run, so the random stream of the resumed
    run continues exactly where the saved one stopped.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        rank_state: Callable[[], dict[str, Any]],
        heartbeat: Heartbeat,
        *,
        resume_rng: dict[str, Any] | None = None,
        resumed_step: int | None = None,
        save_at_end: bool = True,
        background: bool = False,
    ) -> None:
        self.manager = manager
        self.rank_state = rank_state
        self.heartbeat = heartbeat
        self._pending_rng = resume_rng
        self.last_saved_step = resumed_step
        self.last_saved_path: str | None = None
        self._seen_step: int | None = None
        self.save_at_end = save_at_end
        self.background = background  # periodic and stop saves staged (checkpoint.async_save)
        self._reserved = False  # the staging buffers reserved (the attempt's first step boundary)
        self.last_held_s: float | None = None  # what the last save held training for
        self._rank_zero = True
        self._flush_loggers = False  # a checkpoint was saved: put the metrics it covers on disk

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._rank_zero = trainer.global_rank == 0
        self.manager.start(trainer, on_failure=self._no_room, background=self.background)  # collective

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None
        self._flush_metrics(trainer)

    def _flush_metrics(self, trainer: pl.Trainer) -> None:
        """After a checkpoint (and the metrics of its last batch, logged after this callback's
        batch end): write what the loggers hold to disk (TensorBoard's writer keeps up to 2 min,
        the CSV logger 100 steps). An attempt killed later then loses no metric its checkpoint
        covers; the next attempt's series goes on from there with no gap (make_loggers)."""
        if not self._flush_loggers:
            return
        self._flush_loggers = False
        for logger in trainer.loggers:
            try:
                logger.save()
            except Exception as exc:  # a tracker must never cost training
                log.warning("could not flush the %s logger: %s", type(logger).__name__, exc)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        faults.point("train.batch_end", step=step)  # the time-limit tests slow every batch down here
        if step == self._seen_step:
            return  # mid-accumulation: not a step boundary
        self._seen_step = step
        if step % self.manager.every_n_steps == 0 and step < trainer.max_steps:
            try:
                self.save(trainer, step, background=self.background)
            except DiskFull as exc:  # every rank alike: a periodic checkpoint is skipped, loudly
                self._no_room(exc)
        elif self.background and not self._reserved and step < trainer.max_steps:
            self.manager.reserve(trainer, step)  # collective: every rank reaches this boundary
        self._reserved = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_at_end:
            self.save(trainer, trainer.global_step)  # must succeed: DiskFull ends the attempt as disk_full
        self.manager.finish_background(trainer)
        self._flush_metrics(trainer)  # a stop's checkpoint: SIGKILL may come before the loggers' teardown

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # also after an exception: a background save that is under way still completes
        try:
            self.manager.wait()
        except Exception as exc:
            log.error("%s", exc)
        if self.manager.publisher is not None:  # another rank of a sharded checkpoint: its files' upload
            self.manager.publisher.close()
        if self.manager.mirror is not None:  # rank 0: the newest checkpoint's upload, before the attempt ends
            self.manager.mirror.close()

    def save_stop(self, trainer: pl.Trainer, step: int) -> str | None:
        """Collective, the stop's checkpoint (lmtrain.preemption.agreement): staged where saves run
        in the background, so that training is held only while each rank copies its part into
        host memory; ``on_train_end`` then waits until it is durable (the attempt ends, and
        requeues, only after that). Synchronous otherwise."""
        return self.save(trainer, step, background=self.background)

    def save(self, trainer: pl.Trainer, step: int, *, background: bool = False) -> str | None:
        """Collective: every rank must call it at the same step. Synchronous saves (the end of
        training) are complete on return, a save of this step still in flight included."""
        if step == self.last_saved_step:  # e.g. a stop at the step of a periodic background save
            t0 = time.perf_counter()
            if self.manager.finish_background(trainer) is None:
                if not background:
                    self.last_held_s = time.perf_counter() - t0  # waiting for it to be durable
                return self.last_saved_path
            # that save found no room: this one must be written after all (or end the attempt)
        state = {"rng": capture_rng(), **self.rank_state()}
        path, blocked = self.manager.save(trainer, step=step, rank_state=state, background=background,
                                          on_complete=self._complete)
        if background and self.manager.can_save_in_background and trainer.global_rank == 0:
            log.info("checkpoint step-%d: training resumed after %.2fs, writing in the background", step, blocked)
        self.last_held_s = blocked
        self.last_saved_step, self.last_saved_path = step, str(path)
        self._flush_loggers = trainer.global_rank == 0
        return str(path)

    def _no_room(self, exc: DiskFull) -> None:
        """A periodic checkpoint (this one, or a background one finishing) found no room: training
        goes on from the newest complete checkpoint; the stop-time and final saves must succeed."""
        if self._rank_zero:
            log.error("%s; training goes on without it (the newest complete checkpoint stays the resume "
                      "point; a stop or the end of training must still find room)", exc)
            self.heartbeat.emit("checkpoint_failed", step=exc.step, reason="disk_full", detail=str(exc),
                                **{k: v for k, v in exc.figures.items() if k != "step"})

    def _complete(self, path: Path, seconds: float, blocked: float) -> None:
        """Rank 0, when a checkpoint is complete (from the writer thread for background saves):
        ``seconds`` from the save's start to COMPLETE, ``blocked`` of them holding training up."""
        step = step_of(path)
        self.heartbeat.emit("checkpoint", step=step, path=str(path), seconds=round(seconds, 3),
                            blocked_s=round(blocked, 3))
        log.info("checkpoint step-%d complete in %.2fs (training held %.2fs): %s", step, seconds, blocked, path)
