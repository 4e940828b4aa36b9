"""Results computed once per test run and shared by every test (and every parallel worker) that
needs them: the uninterrupted reference runs that resumed runs are compared with, bit for bit.

``shared(key, compute)`` returns ``compute()``'s value. The first worker to ask computes it under
an flock while the others wait, then reads the pickled value. A failure is shared too: the
waiting tests fail with the first one's error instead of computing the same thing again.

Where the values live: ``$LMLAUNCH_TEST_SHARED`` (scripts/test.sh makes a fresh directory for each
test run: the parallel and the serial phase share it), else a directory beside this session's
pytest temporary directories (shared by its xdist workers, new for each pytest session).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
_ROOT: Path | None = None


class SharedResultFailed(AssertionError):
    """The shared computation failed (here or in another worker); its error, as text."""


def configure(tmp_path_factory) -> Path:
    """Decide the directory once per process (called by the root conftest)."""
    global _ROOT
    explicit = os.environ.get("LMLAUNCH_TEST_SHARED")
    if explicit:
        _ROOT = Path(explicit)
    else:
        base = tmp_path_factory.getbasetemp()
        # xdist workers' basetemps are <session>/popen-gwN: share <session>
        _ROOT = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-results"
    _ROOT.mkdir(parents=True, exist_ok=True)
    return _ROOT


def directory() -> Path:
    """Where this test run's shared results live: a shared computation that makes files (a reference
    run's directory) makes them under it, so that every worker reads the same ones."""
    if _ROOT is None:
        raise RuntimeError("shared_results.configure() was not called (tests/conftest.py does it)")
    return _ROOT


def shared(key: str, compute: Callable[[], T]) -> T:
    if _ROOT is None:
        raise RuntimeError("shared_results.configure() was not called (tests/conftest.py does it)")
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    value, failure, lock = _ROOT / f"{stem}.pickle", _ROOT / f"{stem}.failed", _ROOT / f"{stem}.lock"
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first worker computes; the others wait here
        if value.exists():
            with open(value, "rb") as f:
                return pickle.load(f)  # written by this test run (never from elsewhere)
        if failure.exists():
            raise SharedResultFailed(f"shared result {key!r} failed earlier in this test run:\n{failure.read_text()}")
        try:
            result = compute()
        except BaseException as exc:
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and type(exc).__name__ != "Skipped":
                worker = os.environ.get("PYTEST_XDIST_WORKER", "the serial session")
                failure.write_text(f"(in {worker}) {type(exc).__name__}: {exc}")
            raise
        tmp = value.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.rename(value)
        return result
