"""Task arrays of any length: cut at the cluster's MaxArraySize into arrays submitted one after
another, each starting when the one before it ended (``afterany``), so a throttle (``%K``) holds
over all of them and the queue holds one array's tasks at a time (datatrove's SlurmPipelineExecutor
does the same). Used by ``lmlaunch sweep`` and ``lmlaunch data prepare --on-cluster``.

A submission that fails part way cancels the arrays it had queued: all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from lmcore.errors import SlurmUnavailable, UserError
from lmcore.slurm import client as slurm

DEFAULT_MAX_ARRAY_SIZE = 1001  # SLURM's default MaxArraySize: task ids 0..1000


def max_array_size(*, query: bool = True) -> int:
    """The cluster's MaxArraySize (tasks per array: ids 0..MaxArraySize - 1); SLURM's default
    when it is not to be asked, cannot be, or does not say."""
    if not query:
        return DEFAULT_MAX_ARRAY_SIZE
    try:
        text = slurm.config().get("MaxArraySize", "")
    except (UserError, SlurmUnavailable):
        return DEFAULT_MAX_ARRAY_SIZE
    return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_MAX_ARRAY_SIZE


def chunks(tasks: int, size: int) -> list[range]:
    """Tasks 0..tasks-1 cut into consecutive ranges of at most ``size``."""
    if size < 1:
        raise ValueError(f"an array holds at least one task, got size {size}")
    return [range(lo, min(lo + size, tasks)) for lo in range(0, tasks, size)]


def submit_chained(tasks: int, size: int, submit: Callable[[range, str | None], str]) -> list[str]:
    """``submit(range, dependency)`` for each chunk of ``tasks``, each after the one before
    (``afterany:<array>``); the array job ids. When one fails, those already queued are
    cancelled and the error raised."""
    arrays: list[str] = []
    dependency = None
    try:
        for part in chunks(tasks, size):
            arrays.append(submit(part, dependency))
            dependency = f"afterany:{arrays[-1]}"
    except BaseException:
        if arrays:
            slurm.cancel(arrays)
        raise
    return arrays
