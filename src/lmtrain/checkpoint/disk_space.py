"""A full disk under the checkpoints: found before a save writes anything where it can be, told
apart from a crash where it cannot, and always described with the figures (what the checkpoint
needs, what is free) instead of a traceback.

A save first compares the room it needs (the newest complete checkpoint's size, or before the
first one an estimate from the parameter count, ``lmcore.run.checkpoint_index.checkpoint_bytes``) with
the free space of the checkpoint directory's filesystem; a write that still finds no room
(``ENOSPC``/``EDQUOT``, on any rank) is agreed by every rank, the partial save is removed and
:class:`DiskFull` is raised on every rank. The callers decide what it costs: a periodic save
is skipped (training goes on, loudly), a stop-time or final save ends the attempt as
``disk_full`` (lmtrain.preemption.policy), which never spends a crash retry nor requeues into the same wall.
"""

from __future__ import annotations

import errno
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import is_complete

log = logging.getLogger("lmtrain.checkpoint.manager")

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFull(RuntimeError):
    """A checkpoint could not be written for want of room; ``figures`` go to the ledger."""

    def __init__(self, directory: str | Path, step: int, needed: int | None, free: int | None, how: str) -> None:
        self.directory, self.step, self.needed, self.free, self.how = str(directory), step, needed, free, how
        need = f"needs {gb(needed)}" if needed is not None else "needs more room"
        have = f"{gb(free)} free" if free is not None else "free space unknown"
        super().__init__(f"checkpoint step-{step} cannot be written to {directory}: {have}, the checkpoint {need} "
                         f"({how}); nothing partial was left")

    @property
    def figures(self) -> dict[str, Any]:
        return {"directory": self.directory, "step": self.step, "needed_bytes": self.needed,
                "free_bytes": self.free, "how": self.how}

    @classmethod
    def from_figures(cls, f: dict[str, Any]) -> DiskFull:
        return cls(f["directory"], int(f["step"]), f.get("needed_bytes"), f.get("free_bytes"), str(f.get("how", "")))


def gb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def is_no_space(exc: BaseException | None) -> bool:
    """``exc``, or an exception it was raised from, is the OSError of a full disk or quota."""
    while exc is not None:
        if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS):
            return True
        exc = exc.__cause__
    return False


def disk_full_in(exc: BaseException | None) -> DiskFull | None:
    """The DiskFull ``exc`` is or was raised from (what an attempt that ended on it records)."""
    while exc is not None:
        if isinstance(exc, DiskFull):
            return exc
        exc = exc.__cause__
    return None


def free_bytes(directory: str | Path) -> int | None:
    """Free bytes for an unprivileged writer on the filesystem of ``directory`` (or of its
    nearest existing parent); None when it cannot be asked."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def room_verdict(directory: str | Path, step: int, needed: int | None, free: int | None) -> DiskFull | None:
    """Pure: the DiskFull a save of ``needed`` bytes would meet with ``free`` bytes free."""
    if needed is None or free is None or free >= needed:
        return None
    return DiskFull(directory, step, needed, free, "checked before writing")


def no_room(fn: Callable[[], None], directory: str | Path, needed: Callable[[], int | None]) -> BaseException | None:
    """Run a checkpoint write ``fn``; what it raised when that means no room, else it propagates.
    No room: an OSError of a full disk, or any error of the write (``torch.save`` to a path says
    only "unexpected pos") after which the filesystem has less room than the checkpoint needs."""
    try:
        fn()
    except Exception as exc:
        if not means_no_room(exc, directory, needed):
            raise
        log.error("checkpoint write: %s", exc)
        return exc
    return None


def means_no_room(exc: BaseException, directory: str | Path, needed: Callable[[], int | None]) -> bool:
    """A checkpoint write's error means no room (:func:`no_room` says how it tells)."""
    if is_no_space(exc):
        return True
    free, need = free_bytes(directory), needed()
    return free is not None and need is not None and free < need


def remove_partial(tmp: Path, final: Path) -> None:
    """Rank 0: a save that failed leaves nothing behind (a renamed but not COMPLETE ``final`` too)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if final.exists() and not is_complete(final):
        shutil.rmtree(final, ignore_errors=True)
