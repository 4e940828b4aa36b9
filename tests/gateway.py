"""The local cluster's S3 gateway is one per machine: the tests that use it share it, the tests that
kill or stop it (a power cut, `cluster down`, an upload cut by the gateway's death) have it alone.

A readers-writer lock on a file beside no checkout (``flock``: shared for a user, exclusive for a
killer), so that a test killing the gateway on one pytest worker never cuts another worker's
requests, nor another checkout's suite on the same machine. The lock is released with its file
descriptor, also when the test fails."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = Path(os.environ.get("LMLAUNCH_TEST_GATEWAY_LOCK", "/tmp/lmlaunch-test-s3-gateway.lock"))


@contextmanager
def _held(mode: int) -> Iterator[None]:
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, mode)  # waits for the holders of the other kind, however long their tests take
        yield
    finally:
        os.close(fd)


@contextmanager
def shared() -> Iterator[None]:
    """Using the gateway: any number at once, never while it is being killed."""
    with _held(fcntl.LOCK_SH):
        yield


@contextmanager
def alone() -> Iterator[None]:
    """Killing or stopping the gateway: while no other test uses it."""
    with _held(fcntl.LOCK_EX):
        yield
