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
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == list(range(max_steps)), (steps, _tensorboard_files(run_dir))
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == list(range(max_steps))


def _tensorboard_files(run_dir: Path) -> dict[str, list]:
    """For a failure message: each event file's train/loss steps and session starts ('S', step)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = {}
    for path in sorted((run_dir / "tensorboard" / "version_0").glob("events.out.tfevents.*")):
        seen: list = []
        for ev in EventFileLoader(str(path)).Load():
            if ev.HasField("session_log"):
                seen.append(("S", ev.step))
            elif any(v.tag == "train/loss" for v in ev.summary.value):
                seen.append(ev.step)
        files[path.name] = seen
    return files
