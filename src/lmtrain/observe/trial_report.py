"""A search trial's rank 0 reports its metric to the study and learns it is pruned
(:mod:`lmcore.search.study` owns Optuna; the driver, ``launcher.search.driver``, asks and ends trials).

At each value the run logs of the search's metric (``loss`` on the logging steps, ``val_loss`` at
each validation: the very values the heartbeat records), rank 0 calls ``trial.report(value, step)``
and asks the pruner ``should_prune()``; when it says so, rank 0 requests a stop with reason
``pruned``: the stop agreement takes every rank to the next step boundary, the checkpoint is
written and kept, and the ledger ends the attempt ``pruned`` (never requeued). The driver then
records the trial as pruned.

A step reported before (the steps between a checkpoint and a preemption, trained again after
the requeue) is not reported twice. A study that cannot be reached costs the run nothing: the
trial trains on and is not pruned (a warning says why); a trial the study already ended (the
driver recorded it failed) stops reporting.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

log = logging.getLogger("lmtrain")


class TrialReport(pl.Callback):
    """Rank 0's link to its trial (other ranks get none: the stop agreement tells them)."""

    def __init__(self, plan: dict[str, Any], request_stop: Callable[[str, str], None]) -> None:
        from lmcore.search.study import TrialPlan

        self.plan = TrialPlan.from_json(plan)
        self.request_stop = request_stop
        self._trial: Any = None
        self._reported: set[int] = set()
        self._closed = False
        self._pruned = False

    # -- the values, as the heartbeat logs them ------------------------------------------------
    def step_metrics(self, metrics: dict[str, Any], max_steps: int) -> None:
        if self.plan.metric == "loss":
            self.report(metrics.get("loss"), int(metrics["step"]))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.plan.metric != "val_loss":
            return
        val = trainer.callback_metrics.get("val/loss")
        if val is not None:
            self.report(float(val), trainer.global_step)

    # -- the study ------------------------------------------------------------------------------
    def _open(self) -> Any:
        if self._trial is None:
            import optuna

            from lmcore.search.study import open_storage, pruner

            storage = open_storage(self.plan.storage)
            study = optuna.load_study(study_name=self.plan.study, storage=storage, pruner=pruner(self.plan.pruner))
            trial_id = storage.get_trial_id_from_study_id_trial_number(
                storage.get_study_id_from_name(self.plan.study), self.plan.number)
            self._trial = optuna.trial.Trial(study, trial_id)
            done = storage.get_trial(trial_id).intermediate_values
            self._reported = set(done)  # reported by an earlier attempt of this trial
        return self._trial

    def report(self, value: Any, step: int) -> None:
        if self._closed or self._pruned or value is None:
            return
        try:
            v = float(value)
        except (TypeError, ValueError):
            return
        if not math.isfinite(v):
            return  # a NaN loss is the run's to report (it crashes or recovers), not the pruner's
        try:
            trial = self._open()
            if step not in self._reported:
                trial.report(v, step)
                self._reported.add(step)
            prune = trial.should_prune()
        except Exception as exc:  # the study is the search's, never the run's failure
            import optuna

            if isinstance(exc, RuntimeError) and "finished" in str(exc).lower() or \
                    isinstance(exc, optuna.exceptions.UpdateFinishedTrialError):
                log.warning("trial %d of search %s is already ended in the study: not reporting to it any more",
                            self.plan.number, self.plan.study)
                self._closed = True
            else:
                log.warning("trial %d of search %s: could not report %s=%.6g at step %d to the study (%s: %s); "
                            "training on", self.plan.number, self.plan.study, self.plan.metric, v, step,
                            type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
                self._trial = None  # open it again at the next value
            return
        if prune:
            self._pruned = True
            why = (f"pruned by search {self.plan.study} ({self.plan.pruner.get('name', 'median')} pruner) at step "
                   f"{step}: {self.plan.metric} {v:.6g}")
            log.info("%s; stopping at the next step boundary (the checkpoint is kept)", why)
            self.request_stop("pruned", why)
