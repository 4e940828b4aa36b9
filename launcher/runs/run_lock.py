"""One change of a run at a time: submitting it (the check that no job of it is queued, sbatch,
the registry's record), moving it between clusters (hold, cancel, submit elsewhere) and cancelling
it each hold the run's lock, so a move never races a `submit --resume` or a `cancel` into two
queued attempts or an undone cancel.

The lock is an flock on ``$LMLAUNCH_HOME/registry/.<run>.lock`` (beside the run's record: it exists
before the run directory does). Re-entrant within a process: a move submits through the same
``submit_plan`` that takes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from launcher.runs.home import lmlaunch_home
from lmcore.errors import UserError
from lmcore.run.run_layout import RunLayout

WAIT_S = 300.0  # longer than a move holds it (a minute for the cancelled job to leave its queue, then a submission)
_HELD: dict[str, int] = {}
_GUARD = threading.Lock()


@contextlib.contextmanager
def run_lock(name: str, environ: Mapping[str, str] | None = None, *, wait_s: float = WAIT_S) -> Iterator[None]:
    """Within: no other lmlaunch process changes run ``name``; waits up to ``wait_s`` for one that does."""
    path = lmlaunch_home(environ) / "registry" / f".{name}.lock"
    key = str(path)
    with _GUARD:
        if _HELD.get(key):
            _HELD[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _GUARD:
                _HELD[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"run '{name}' is being changed by another lmlaunch (a submit, a move or a cancel "
                                    f"holds {path}) for more than {wait_s:.0f} s; try again", exit_code=1) from None
                time.sleep(0.2)
        with _GUARD:
            _HELD[key] = 1
        try:
            yield
        finally:
            with _GUARD:
                _HELD.pop(key, None)
    finally:
        os.close(fd)  # releases the flock


def watcher_alive(run_dir: str | Path) -> bool:
    """Whether the run's watcher (launcher.submit.watcher) runs: it holds ``RUN/mover.lock`` (an flock,
    gone with its process) from its start to its end."""
    lock = RunLayout.of(run_dir).mover_lock
    try:
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: no watcher ever started here
        return False
    return False
