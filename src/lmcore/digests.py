"""The checksum of a file as lmlaunch records it (a checkpoint's manifest, a bucket's commit): xxh3_128
of its bytes, read in 8 MB pieces."""

from __future__ import annotations

from pathlib import Path

ALGORITHM = "xxh3_128"
_READ = 8 << 20


def file_digest(path: Path) -> str:
    import xxhash  # only where files are checked: the CLI's listing never needs it

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while piece := f.read(_READ):
            h.update(piece)
    return h.hexdigest()
