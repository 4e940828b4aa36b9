"""Run a task (lmtrain.task.entry.run_task) in this process with extra Lightning callbacks: for the
helper scripts that watch or steer a real attempt from inside (signals at a step, dumps of what
the Trainer was built with). The product has no hook for this; the helper wraps
``lmtrain.task.fit.Fit.callbacks`` for this process only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_task_with(run_dir: str, make: Callable[[Any], list[Any]]) -> int:
    """``make(controller)`` -> the extra callbacks (``controller``: the attempt's
    lmtrain.preemption.controller.Preemption, whose ``stop`` a callback may request)."""
    from lmtrain.task import fit
    from lmtrain.task.entry import run_task

    own = fit.Fit.callbacks

    def callbacks(self: Any, startup: Any) -> list[Any]:
        return [*own(self, startup), *make(self.ctl)]

    fit.Fit.callbacks = callbacks  # type: ignore[method-assign]
    return run_task(run_dir)
