"""Shared by unit and integration tests: what the metric loggers hold after a run's attempts."""

from __future__ import annotations

import csv
from pathlib import Path


def assert_trackers_log_each_step_once(run_dir: Path, max_steps: int) -> None:
    """TensorBoard (read with its own reader) and the CSV logger hold one series per metric over
    all attempts: every step once, in order, none missing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard" / "version_0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(max_steps))
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == list(range(max_steps))
