"""Lightning callbacks of the runtime: heartbeat, checkpoints, RNG-neutral validation, the
stop-at-step-boundary slot (filled by preemption handling), and the run-directory loggers.

Heartbeat and ledger formats: docs/run-directory.md. Lines are whole JSON objects written with
one ``write`` and flushed, so a reader that skips an unparsable last line never sees half a line.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from launcher.core.rundir import Heartbeat, Ledger
from lmtrain import faults
from lmtrain.checkpoint import CheckpointManager
from lmtrain.disk_space import DiskFull
from lmtrain.rng_state import capture_rng, restore_rng
from lmtrain.startup import CLOCK

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    """Who this attempt is (for heartbeat, ledger and checkpoint metadata)."""

    run_dir: str
    attempt: int
    job_id: str
    restart_count: int
    world_size: int
    rank: int
    nodes: list[str]
    max_steps: int

def heartbeat_of(path: str | Path, info: RunInfo) -> Heartbeat:
    """This attempt's heartbeat writer: rank 0 writes, the other ranks' emits do nothing."""
    return Heartbeat(path, attempt=info.attempt, job_id=info.job_id, world_size=info.world_size,
                     enabled=info.rank == 0)


class CheckpointCallback(pl.Callback):
    """Periodic and final checkpoints (collective), and exact restoration of per-rank RNG state.

    ``rank_state`` returns what each rank saves besides Lightning's checkpoint (data position);
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
        self.background = background  # periodic saves in the background (checkpoint.async_save)
        self._rank_zero = True
        self._flush_loggers = False  # a checkpoint was saved: put the metrics it covers on disk

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._rank_zero = trainer.global_rank == 0
        self.manager.start(trainer, on_failure=self._no_room, background=self.background)  # collective

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
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

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_at_end:
            self.save(trainer, trainer.global_step)  # must succeed: DiskFull ends the attempt as disk_full
        self.manager.finish_background(trainer)
        self._flush_metrics(trainer)  # a stop's checkpoint: SIGKILL may come before the loggers' teardown

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # also after an exception: a background save that is under way still completes
        try:
            self.manager.wait()
        except Exception as exc:
            log.error("%s", exc)

    def save(self, trainer: pl.Trainer, step: int, *, background: bool = False) -> str | None:
        """Collective: every rank must call it at the same step. Synchronous saves (a stop, the
        end of training) are complete on return, a save of this step still in flight included."""
        if step == self.last_saved_step:  # e.g. a stop at the step of a periodic background save
            if self.manager.finish_background(trainer) is None:
                return self.last_saved_path
            # that save found no room: this one must be written after all (or end the attempt)
        state = {"rng": capture_rng(), **self.rank_state()}
        path, blocked = self.manager.save(trainer, step=step, rank_state=state, background=background,
                                          on_complete=self._complete)
        if background and self.manager.can_save_in_background and trainer.global_rank == 0:
            log.info("checkpoint step-%d: training resumed after %.2fs, writing in the background", step, blocked)
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

    def _complete(self, path, seconds: float, blocked: float) -> None:
        """Rank 0, when a checkpoint is complete (from the writer thread for background saves):
        ``seconds`` from the save's start to COMPLETE, ``blocked`` of them holding training up."""
        step = int(path.name.removeprefix("step-"))
        self.heartbeat.emit("checkpoint", step=step, path=str(path), seconds=round(seconds, 3),
                            blocked_s=round(blocked, 3))
        log.info("checkpoint step-%d complete in %.2fs (training held %.2fs): %s", step, seconds, blocked, path)


class StartupRecord(pl.Callback):
    """Marks the ``restore`` and ``first_step`` phases of this attempt's startup
    (lmtrain.startup) and, on rank 0, writes them into the ledger at the first step."""

    def __init__(self, ledger: Ledger, *, attempt: int, job_id: str | None, rank: int, start_step: int,
                 checkpoint_bytes: int | None) -> None:
        self.ledger, self.attempt, self.job_id, self.rank = ledger, attempt, job_id, rank
        self.start_step, self.checkpoint_bytes = start_step, checkpoint_bytes
        self.written = False

    def on_train_start(self, trainer, pl_module) -> None:
        CLOCK.mark("restore")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
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


class RngNeutralValidation(pl.Callback):
    """Validation must not move the training random stream (DataLoader iterator creation draws
    from the global torch RNG): save it before validation, restore it after. This keeps a run
    that resumes from a checkpoint bit-identical to one that did not stop."""

    def __init__(self) -> None:
        self._saved: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._saved = (torch.get_rng_state(), cuda)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._saved is None:
            return
        cpu, cuda = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        self._saved = None


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

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val/loss")
        if val is not None:
            self.heartbeat.emit("val", step=trainer.global_step, val_loss=float(val))


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv; on resume we append to it, after
    dropping the rows of the steps the resumed attempt trains again (``keep_below``: Lightning's
    logged step of the first step after the checkpoint), so no step appears twice."""

    def __init__(self, log_dir: str, keep_below: int | None = None) -> None:
        self.keep_below = keep_below
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows or not rows[0]:
            return
        header = rows[0]
        self.metrics_keys = sorted(header)
        if self.keep_below is None or "step" not in header:
            return
        at = header.index("step")
        kept = [r for r in rows[1:] if len(r) > at and r[at].isdigit() and int(r[at]) < self.keep_below]
        if len(kept) != len(rows) - 1:
            tmp = f"{self.metrics_file_path}.tmp-{os.getpid()}"
            with open(tmp, "w", newline="") as f:
                csv.writer(f).writerows([header, *kept])
            os.replace(tmp, self.metrics_file_path)


class ResumableCSVLogger(CSVLogger):
    """CSVLogger whose fixed version directory survives resume (rows are appended)."""

    def __init__(self, *args: Any, resume_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        os.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _AppendingWriter(log_dir=self.log_dir, keep_below=self.resume_step)
        return self._experiment


def make_loggers(run_dir: str | Path, logging_spec: dict[str, Any], run_name: str,
                 resume_step: int | None = None) -> list[Any]:
    """TensorBoard and CSV in the run directory with a fixed version (0), so every attempt of a
    run writes into the same directories; W&B with an id derived from the run directory.

    ``resume_step``: the checkpoint's step this attempt resumes from. Lightning logs the step
    that follows checkpoint S under index S, so what an earlier attempt logged at indices >= S
    (work done after its last checkpoint, trained again now) is dropped: TensorBoard purges it
    (``purge_step``), the CSV rows are removed. Each metric stays one series, every index once."""
    loggers: list[Any] = []
    run_dir = str(run_dir)
    purge = {"purge_step": resume_step} if resume_step else {}
    if logging_spec.get("tensorboard", True):
        loggers.append(TensorBoardLogger(save_dir=run_dir, name="tensorboard", version=0, default_hp_metric=False,
                                         **purge))
    if logging_spec.get("csv", True):
        loggers.append(ResumableCSVLogger(save_dir=run_dir, name="csv", version=0, resume_step=resume_step))
    wandb = logging_spec.get("wandb")
    if wandb:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(
            WandbLogger(
                project=wandb["project"],
                entity=wandb.get("entity"),
                name=run_name,
                id=wandb_run_id(run_dir),
                resume="allow",
                offline=wandb.get("mode") == "offline",
                save_dir=run_dir,
            )
        )
    return loggers


WANDB_ID_FILE = "wandb_id"


def wandb_run_id(run_dir: str) -> str:
    """The run's W&B run id, persisted in ``<run_dir>/wandb_id``: every attempt of the run logs
    into the same W&B run (with resume="allow"). Made once, at random (a run started over with
    ``--new`` at the same path gets a new one); the first rank to create the file wins."""
    import uuid

    path = Path(run_dir) / WANDB_ID_FILE
    try:
        existing = path.read_text().strip()
        if existing:
            return existing
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{WANDB_ID_FILE}.tmp-{os.getpid()}")
    tmp.write_text(uuid.uuid4().hex[:16] + "\n")
    try:
        os.link(tmp, path)  # atomic create-if-absent: concurrent ranks agree on one id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def logger_identity(run_dir: str, logging_spec: dict[str, Any]) -> dict[str, Any]:
    ident: dict[str, Any] = {"tensorboard_version": 0, "csv_version": 0}
    if logging_spec.get("wandb"):
        ident["wandb_id"] = wandb_run_id(run_dir)
    return ident


__all__ = [
    "CheckpointCallback",
    "heartbeat_of",
    "MetricsHeartbeat",
    "ResumableCSVLogger",
    "RngNeutralValidation",
    "RunInfo",
    "make_loggers",
]
