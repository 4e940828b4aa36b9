"""Lightning callbacks of the runtime: the startup record, metrics into the heartbeat, RNG-neutral
validation, the accumulation realigned after an elastic resume. (Checkpoints:
:mod:`lmtrain.checkpoint.callback`; the stop agreement: :mod:`lmtrain.preemption.agreement`;
loggers: :mod:`lmtrain.observe.loggers`.)

Heartbeat and ledger formats: docs/run-directory.md. Lines are whole JSON objects written with
one ``write`` and flushed, so a reader that skips an unparsable last line never sees half a line.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch

from lmcore.run.rundir import Heartbeat, Ledger
from lmtrain.observe.startup import CLOCK

log = logging.getLogger(__name__)


class StartupRecord(pl.Callback):
    """Marks the ``restore`` and ``first_step`` phases of this attempt's startup
    (lmtrain.observe.startup) and, on rank 0, writes them into the ledger at the first step."""

    def __init__(self, ledger: Ledger, *, attempt: int, job_id: str | None, rank: int, start_step: int,
                 checkpoint_bytes: int | None) -> None:
        self.ledger, self.attempt, self.job_id, self.rank = ledger, attempt, job_id, rank
        self.start_step, self.checkpoint_bytes = start_step, checkpoint_bytes
        self.written = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        CLOCK.mark("restore")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.written and trainer.global_step > self.start_step:  # an optimizer step, not a micro-batch
            CLOCK.mark("first_step")
            if self.rank == 0:
                self.write()
            self.written = True  # every rank: nothing more to do per step

    def write(self) -> None:
        """Rank 0: the ledger's ``startup`` line (once; also when the attempt ends before its first step)."""
        self.written = True
        try:
            self.ledger.write(CLOCK.record(self.attempt, self.job_id, self.checkpoint_bytes))
        except OSError as exc:  # a timing record never costs the run
            log.warning("could not write the startup timing of attempt %d: %s", self.attempt, exc)


class RealignAccumulation(pl.Callback):
    """Resuming on another world size changes the gradient accumulation (the global batch stays):
    Lightning restores its count of micro batches from the checkpoint and steps the optimizer when
    that count is a multiple of the *new* accumulation, so a count written with accumulation 1
    (7 micro batches at step 7) and read with accumulation 2 would step after one micro batch, on
    half a batch. Rescale the restored counts to ``steps x new accumulation`` before training."""

    def __init__(self, old_accumulate: int, new_accumulate: int) -> None:
        self.old = old_accumulate
        self.new = new_accumulate

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        for part in (progress.current, progress.total):
            # Shift every count by the same amount: the checkpoint was written in on_train_batch_end,
            # where `completed` is one behind `ready`, and Lightning adds that one back on restart.
            shift = part.ready // self.old * self.new - part.ready
            for name in ("ready", "started", "processed", "completed"):
                setattr(part, name, getattr(part, name) + shift)
        log.info("gradient accumulation %d -> %d: micro-batch counts rescaled (%d in this epoch)",
                 self.old, self.new, progress.current.ready)


class AlignStepCount(pl.Callback):
    """A pipeline steps its optimizer by hand (Lightning's manual optimization), the other layouts
    through Lightning's automatic loop, and Lightning counts each loop's optimizer steps apart: a
    checkpoint written by one and resumed by the other would restart the count at 0. Set the
    running loop's count to the checkpoint's step before training (a no-op on the same layout)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop
        if pl_module.automatic_optimization:
            progress = loop.automatic_optimization.optim_progress.optimizer.step
        else:
            progress = loop.manual_optimization.optim_step_progress
        if trainer.global_step == self.step:
            return
        for part in (progress.total,):
            part.ready = part.completed = self.step
        log.info("optimizer steps counted from the checkpoint's step %d (written by the other optimization loop)",
                 self.step)


class RngNeutralValidation(pl.Callback):
    """Validation must not move the training random stream (creating the validation DataLoader's
    iterator draws its base seed from the global torch RNG): the stream as the last training
    batch left it is restored after validation. This keeps a run resumed from a checkpoint of a
    validation step (a stop there checkpoints before validation runs) bit-identical to one that
    did not stop.

    The snapshot is taken at every training batch's end, not at ``on_validation_start``: Lightning's
    evaluation loop creates its iterator (the draw) before it calls that hook. Nothing between a
    batch's end and the validation that follows it draws for training. Costs ~2 us a batch."""

    def __init__(self) -> None:
        self._saved: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._saved = (torch.get_rng_state(), cuda)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved is None or trainer.sanity_checking:
            return
        cpu, cuda = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class MetricsHeartbeat(pl.Callback):
    """The heartbeat's ``step`` lines (called by the module on its logging steps, thinned to every
    ``every_n_steps``) and ``val`` lines."""

    def __init__(self, heartbeat: Heartbeat, every_n_steps: int = 1) -> None:
        self.heartbeat = heartbeat
        self.every_n_steps = every_n_steps

    def step_metrics(self, metrics: dict[str, Any], max_steps: int) -> None:
        step = metrics["step"]
        if step % self.every_n_steps and step != max_steps:
            return
        self.heartbeat.emit("step", max_steps=max_steps, **metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val/loss")
        if val is not None:
            self.heartbeat.emit("val", step=trainer.global_step, val_loss=float(val))
