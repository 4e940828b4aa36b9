"""JSON lines: one whole line per ``write`` (O_APPEND), so concurrent writers never interleave,
and readers that skip a line that does not parse (a write in progress, or the torn last line of
a process that was SIGKILLed). The run directory's ledger and heartbeat are JSON lines
(:mod:`lmcore.run.rundir`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HEARTBEAT_TAIL_BYTES = 16384  # ~60 heartbeat lines: enough for the last step, checkpoint and rate


def append_jsonl(path: str | Path, obj: Mapping[str, Any]) -> None:
    """Append one JSON line in a single write (O_APPEND): concurrent writers never interleave."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(dict(obj)) + "\n").encode()
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """JSON objects, one per line; a line that does not parse is skipped."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    try:
        return parse_jsonl(Path(path).read_text(errors="replace"))
    except OSError:
        return []


def tail_text(path: str | Path, max_bytes: int) -> str | None:
    """The last whole lines of ``path`` within its last ``max_bytes`` (never the whole file); None
    when it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return None
    if start > 0:
        nl = data.find(b"\n")
        data = data[nl + 1 :] if nl >= 0 else b""  # the first line is cut: drop it
    return data.decode("utf-8", errors="replace")


def read_tail(path: str | Path, max_bytes: int = HEARTBEAT_TAIL_BYTES) -> list[dict[str, Any]]:
    """The last whole JSON lines of ``path`` within its last ``max_bytes`` (never the whole file)."""
    return parse_jsonl(tail_text(path, max_bytes) or "")
