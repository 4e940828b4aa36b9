"""Compiled modules for the code snapshot's zip, kept across submissions (:func:`default_dir`:
``$XDG_CACHE_HOME/lmlaunch/bytecode``, else ``~/.cache/lmlaunch/bytecode``; content-addressed, so
every lmlaunch home and checkout of a user shares it).

Each submission zips the launcher, lmcore and lmtrain with bytecode beside every module
(launcher.runs.snapshot.write_zip), each naming its file in that run's directory: compiling the ~280
modules took about 0.44 s of a 0.75 s submission. A module's code object is compiled once per source
and interpreter, kept marshalled here, and given the run's file name by replacing ``co_filename`` in
it and every code object it holds (about 12x cheaper than compiling: bench/cli_latency.py
``--snapshot``). Entries are written whole (a temporary file renamed) and those unused for
:data:`KEEP_DAYS` are removed.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import time
import types
from pathlib import Path

KEEP_DAYS = 30
_PLACEHOLDER = "<lmlaunch-snapshot>"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmlaunch" / "bytecode"


def _key(data: bytes) -> str:
    from importlib.util import MAGIC_NUMBER

    return hashlib.sha256(MAGIC_NUMBER + sys.version.encode() + b"\0" + data).hexdigest()


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def module_code(data: bytes, filename: str, cache: Path | None) -> types.CodeType:
    """``data`` compiled as a module whose file is ``filename``; from ``cache`` when it holds this
    source (compiled and kept there otherwise; no cache: compiled)."""
    if cache is None:
        return compile(data, filename, "exec", dont_inherit=True)
    path = cache / f"{_key(data)}.marshal"
    try:
        code = marshal.loads(path.read_bytes())
        os.utime(path)  # used: kept another KEEP_DAYS
    except (OSError, ValueError, EOFError, TypeError):
        code = compile(data, _PLACEHOLDER, "exec", dont_inherit=True)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_bytes(marshal.dumps(code))
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written costs only the next submission's compile
    return _renamed(code, filename)


def prune(cache: Path, *, now: float | None = None) -> int:
    """Remove entries unused for KEEP_DAYS (an older checkout's modules); how many went."""
    cutoff = (time.time() if now is None else now) - KEEP_DAYS * 86400
    gone = 0
    try:
        entries = list(os.scandir(cache))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.name.endswith(".marshal") and entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
                gone += 1
        except OSError:
            continue
    return gone
