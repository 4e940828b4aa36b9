"""A rank's look for a profile request (torch-free): ``lmlaunch profile`` writes ``profile-request.json``
into the run directory; every rank looks at its logging steps, one ``stat`` of it, and reads it only
when its mtime changed. lmtrain.observe.profiling (torch.profiler) and the scale harness
(lmtrain.simulate) both ask through :class:`RequestPoll`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_request(path: Path) -> dict[str, Any] | None:
    """The request in the run directory, or None (none, or unreadable: asked again next time)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not isinstance(raw.get("steps"), int):
        return None
    ranks = raw.get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)):
        return None  # not what `lmlaunch profile` writes: ignored, never a crash of the step
    return raw


class RequestPoll:
    def __init__(self, request_path: Path, *, attempt: int, rank: int) -> None:
        self.request_path, self.attempt, self.rank = Path(request_path), attempt, rank
        self.served: set[str] = set()
        self._last_mtime: float | None = None

    def asked(self, step: int, spec: Any = None) -> dict[str, Any] | None:
        """A request for this rank that it has not served: the spec's window (``spec``: the spec's
        profile section or None), or the command's file."""
        request: dict[str, Any] | None
        if spec is not None and step >= spec.start_step and f"spec-{spec.start_step}" not in self.served:
            request = {"id": f"spec-{spec.start_step}", "steps": spec.steps, "ranks": spec.ranks}
        else:
            try:
                mtime = os.stat(self.request_path).st_mtime
            except OSError:
                return None
            if mtime == self._last_mtime:
                return None
            self._last_mtime = mtime
            request = read_request(self.request_path)
        if request is None or request["id"] in self.served or request.get("attempt", self.attempt) != self.attempt:
            return None  # served, or asked of an earlier attempt
        self.served.add(request["id"])
        ranks = request.get("ranks")
        return request if ranks is None or self.rank in ranks else None
