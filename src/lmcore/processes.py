"""Whether a process is alive (one answer for the local cluster's daemons and lmtrain's forked ranks),
and whether it is stopped."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int | None) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, is not alive; a process of
    another user that cannot be signalled is)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (/proc's state T); False when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False
