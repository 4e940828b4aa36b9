"""The SLURM releases lmlaunch is tested on, and what to say about another one.

The suite runs on each of ``TESTED`` (scripts/test.sh: the machine's own SLURM, the other Debian
stable release's and Debian unstable's, from Debian roots). A cluster on another release is not
refused: doctor and `profile init` say which tested release is nearest, so a user knows what
the behaviour was checked against (docs/architecture.md: what differs between releases).
"""

from __future__ import annotations

import re

TESTED = ("22.05", "24.11", "26.05")


def release(version: str | None) -> tuple[int, int] | None:
    """``26.05.5`` -> (26, 5); None for text that is not a SLURM version."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _months(r: tuple[int, int]) -> int:
    return r[0] * 12 + r[1]  # releases are named year.month


def nearest_tested(version: str | None) -> str | None:
    """The tested release closest in time to ``version`` (the newer one on a tie)."""
    r = release(version)
    if r is None:
        return None
    return min(reversed(TESTED), key=lambda t: abs(_months(release(t) or (0, 0)) - _months(r)))


def is_tested(version: str | None) -> bool:
    r = release(version)
    return r is not None and f"{r[0]}.{r[1]:02d}" in TESTED


def untested_note(version: str | None) -> str | None:
    """What to tell a user of a cluster on ``version`` when lmlaunch was never tested on its release."""
    if is_tested(version):
        return None
    tested = ", ".join(TESTED)
    if release(version) is None:
        return f"the cluster's SLURM version {version or '(none given)'!r} could not be read; lmlaunch is tested on {tested}"
    return (f"SLURM {version} is not a release lmlaunch was tested on ({tested}); the nearest tested is "
            f"{nearest_tested(version)}: what its commands print or default to may differ (docs/architecture.md)")
