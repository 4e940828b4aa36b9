"""Callables for tests/unit/test_task_main.py, pickled by reference into a submitit folder and run
by ``python -m lmtrain.task.main`` (PYTHONPATH: the checkout)."""

from __future__ import annotations

import os
import signal

from lmtrain.preemption.signals import own_signals
from lmtrain.task.train_task import TrainTask


def handlers() -> dict[str, str]:
    return {name: getattr(signal.getsignal(getattr(signal, name)), "__qualname__", repr(signal.getsignal(getattr(signal, name))))
            for name in ("SIGUSR2", "SIGTERM")}


class ProbeTask(TrainTask):
    """lmtrain's task as task_main sees it (a TrainTask): which handlers it runs under, what they
    recorded before it started, and whether two more signals are recorded without harm."""

    def __call__(self) -> dict:
        seen = handlers()
        owner = own_signals({"signal": "USR2"})  # the entry's call: the owner task_main installed
        before = {"requested": owner.stop.requested, "reason": owner.stop.reason, "count": owner.record.count}
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)
        return {"handlers": seen, "before": before, "count": owner.record.count}


def plain() -> dict[str, str]:
    return handlers()


def touch(path: str) -> None:
    """A callable whose effect shows without a result pickle: the handlers it ran under, in a file."""
    from pathlib import Path

    Path(path).write_text(repr(handlers()))


def fail() -> None:
    raise ValueError("the task failed on purpose")
