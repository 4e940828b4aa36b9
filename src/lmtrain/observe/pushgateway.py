"""Rank 0's push of the run's training metrics to a Prometheus Pushgateway (spec ``logging.pushgateway``).

For sites whose Prometheus cannot reach the login node: the job pushes instead of being scraped.
At the first logging step N optimizer steps after the last push, rank 0 hands the step's figures to a thread that pushes them (PUT, so the
group holds exactly the newest figures) to ``<url>/metrics/job/lmlaunch/run/<run>``:
``lmlaunch_job_step``, ``_max_steps``, ``_train_loss``, ``_tokens_per_second``, ``_mfu_ratio``
(when known), ``_attempt`` and ``_last_push_timestamp_seconds``. Only the newest figures wait to be
pushed; an unreachable gateway is said once in the rank log and never slows or stops training.
The attempt's end pushes the last figures (a bounded wait).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import lightning.pytorch as pl

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
CLOSE_WAIT_S = 10.0
FIGURES = (("step", "lmlaunch_job_step", "Newest optimizer step the run logged"),
           ("max_steps", "lmlaunch_job_max_steps", "Steps the run trains in all"),
           ("loss", "lmlaunch_job_train_loss", "Mean training loss over the last logging window"),
           ("tokens_per_s", "lmlaunch_job_tokens_per_second", "Training throughput at the last logging step"),
           ("mfu", "lmlaunch_job_mfu_ratio", "Model FLOPs utilisation at the last logging step (0..1)"),
           ("attempt", "lmlaunch_job_attempt", "The attempt pushing (1-based)"))


class Pusher(pl.Callback):
    """Rank 0: pushes the newest logging step's figures in the background (also a Callback: its
    teardown pushes the last ones)."""

    def __init__(self, url: str, *, run: str, attempt: int, every_n_steps: int, push: Any = None) -> None:
        from prometheus_client import push_to_gateway

        self.url, self.run, self.attempt, self.every = url.rstrip("/"), run, attempt, every_n_steps
        self._push = push or push_to_gateway
        self._latest: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._queued_step: int | None = None
        self._warned = False
        self.pushed = 0
        self._thread = threading.Thread(target=self._run, name="lmtrain-pushgateway", daemon=True)
        self._thread.start()

    def step_metrics(self, metrics: dict[str, Any], max_steps: int) -> None:
        """The module's metrics sink (logging steps): the first logging step at least N optimizer
        steps after the last one queued, and the last step, are queued for a push."""
        step = int(metrics["step"])
        if self._queued_step is not None and step - self._queued_step < self.every and step != max_steps:
            return
        self._queued_step = step
        with self._lock:
            self._latest = {**metrics, "max_steps": max_steps, "attempt": self.attempt}
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            closing = self._closed  # read before taking the figures: what close() follows is sent too
            with self._lock:
                figures, self._latest = self._latest, None
            if figures is not None:
                self._send(figures)
            if closing:
                return

    def _send(self, figures: dict[str, Any]) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        registry = CollectorRegistry()
        for key, name, text in FIGURES:
            if figures.get(key) is not None:
                Gauge(name, text, registry=registry).set(float(figures[key]))
        Gauge("lmlaunch_job_last_push_timestamp_seconds", "When rank 0 pushed these figures",
              registry=registry).set(time.time())
        try:
            self._push(self.url, job="lmlaunch", grouping_key={"run": self.run}, registry=registry, timeout=TIMEOUT_S)
            self.pushed += 1
        except Exception as exc:  # an unreachable gateway never costs the run
            if not self._warned:
                log.warning("pushgateway %s: the push failed (%s); training goes on, later pushes are tried "
                            "without another word", self.url, exc)
                self._warned = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=CLOSE_WAIT_S)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()  # the last figures of a fit that raised (Lightning runs no teardown then)
