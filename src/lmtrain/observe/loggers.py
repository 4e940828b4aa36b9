"""The run-directory loggers: TensorBoard and CSV with a fixed version, so every attempt of a
run writes into the same directories (a resumed attempt drops what it trains again), and W&B
under one id per run, whose failures never end training (:func:`tolerant_wandb_logger`)."""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from lmcore.atomic import write_atomic
from lmcore.job.spec import LoggingSpec
from lmcore.run import rundir


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
            text = io.StringIO(newline="")
            csv.writer(text).writerows([header, *kept])
            write_atomic(self.metrics_file_path, text.getvalue())


class ResumableCSVLogger(CSVLogger):
    """CSVLogger whose fixed version directory survives resume (rows are appended)."""

    _experiment: Any  # Lightning's CSVLogger sets it

    def __init__(self, *args: Any, resume_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    def experiment(self) -> Any:
        if self._experiment is not None:
            return self._experiment
        os.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _AppendingWriter(log_dir=self.log_dir, keep_below=self.resume_step)
        return self._experiment


def logging_settings(logging_spec: LoggingSpec | Mapping[str, Any] | None) -> LoggingSpec:
    """The spec's ``logging`` section, typed (a section given as a dict is validated again)."""
    if isinstance(logging_spec, LoggingSpec):
        return logging_spec
    return LoggingSpec.model_validate(dict(logging_spec or {}))


def make_loggers(run_dir: str | Path, logging_spec: LoggingSpec | Mapping[str, Any], run_name: str,
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
    settings = logging_settings(logging_spec)
    if settings.tensorboard:
        loggers.append(TensorBoardLogger(save_dir=run_dir, name=rundir.TENSORBOARD, version=0, default_hp_metric=False,
                                         **purge))
    if settings.csv:
        loggers.append(ResumableCSVLogger(save_dir=run_dir, name=rundir.CSV, version=0, resume_step=resume_step))
    wandb = settings.wandb
    if wandb is not None:
        loggers.append(
            tolerant_wandb_logger()(
                project=wandb.project,
                entity=wandb.entity,
                name=run_name,
                id=wandb_run_id(run_dir),
                resume="allow",
                offline=wandb.mode == "offline",
                save_dir=run_dir,
            )
        )
    return loggers


WANDB_ID_FILE = rundir.WANDB_ID  # in the run directory (lmcore.run.rundir.RunLayout.wandb_id)
log = logging.getLogger(__name__)


def tolerant_wandb_logger() -> type:
    """Lightning's WandbLogger whose calls, once one has failed, are dropped with one warning.

    W&B sends through a service process of its own inside the task, and SLURM signals every process
    of a step: a preemption's SIGTERM ends that service, and the next ``log_metrics`` raised
    ``ConnectionResetError`` inside Lightning's loop, before the stop checkpoint was written (seen
    on the local cluster: each preempted attempt lost its work, and a run preempted early enough
    stopped as making no progress). A logger must never cost training or a checkpoint."""
    from lightning.pytorch.loggers import WandbLogger

    class TolerantWandbLogger(WandbLogger):  # type: ignore[misc]
        failed: str | None = None

        def _guarded(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
            if self.failed is not None:
                return None
            try:
                return call(*args, **kwargs)
            except Exception as exc:  # W&B's own errors, a lost connection: never the training's
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("W&B failed in %s (%s): nothing more is sent to W&B in this attempt; training and "
                            "checkpoints go on (the next attempt resumes the same W&B run)", what, self.failed)
                return None

        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            self._guarded("log_metrics", super().log_metrics, metrics, step)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            self._guarded("log_hyperparams", super().log_hyperparams, params, *args, **kwargs)

        def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
            self._guarded("after_save_checkpoint", super().after_save_checkpoint, checkpoint_callback)

        def finalize(self, status: str) -> None:
            self._guarded("finalize", super().finalize, status)

    return TolerantWandbLogger


def wandb_run_id(run_dir: str) -> str:
    """The run's W&B run id, persisted in ``<run_dir>/wandb_id``: every attempt of the run logs
    into the same W&B run (with resume="allow"). Made once, at random (a run started over with
    ``--new`` at the same path gets a new one); the first rank to create the file wins."""
    import uuid

    path = rundir.RunLayout.of(run_dir).wandb_id
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


def logger_identity(run_dir: str, logging_spec: LoggingSpec | Mapping[str, Any]) -> dict[str, Any]:
    ident: dict[str, Any] = {"tensorboard_version": 0, "csv_version": 0}
    if logging_settings(logging_spec).wandb is not None:
        ident["wandb_id"] = wandb_run_id(run_dir)
    return ident
