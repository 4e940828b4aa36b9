"""Large checkpoint files written at the disk's speed: writeback started while serialising.

A buffered write of a 1.5 GB checkpoint first fills the page cache (the kernel starts writing
dirty pages back only past ``vm.dirty_background_ratio`` of memory), then the fsync of lmtrain's
protocol writes all of it: serialising and writing run one after the other. The stream below
starts the writeback of every chunk as soon as it is written (``sync_file_range(WRITE)``), waits
for the chunk before it and drops its pages from the cache (``posix_fadvise(DONTNEED)``): the
disk works while torch.save serialises, the final fsync finds little left to write, and the
page cache recycles the same few chunks' pages instead of taking 1.5 GB of memory that was free
(first use of such memory is what made buffered writes CPU-bound on the development VM;
``bench/fresh_pages.py``). Measured there (``bench/checkpoint_io.py``, bench/RESULTS.md).

Where ``sync_file_range`` is missing or refused (not Linux, a filesystem that does not support
it) the stream writes plainly; a real I/O error from it (no space, EIO) is raised as the
``OSError`` a write would raise, so lmtrain.checkpoint.disk_space treats it alike. The stream also hashes
what passes: the file's checksum for the checkpoint's manifest (lmtrain.checkpoint.checksums).

torch.save's zip records are written without their CRC32 (:func:`_no_zip_crc32`): miniz computes it
on the writing thread at about 4 GB/s, a quarter of a second per GB that the disk waits for
(15.4 GB of a ZeRO-2 Llama 1.1B checkpoint, durable in 1.50x dd's time on an H200); every file has
its xxh3 checksum in the manifest, checked at resume, and torch.load does not read the CRC.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from lmtrain.checkpoint import checksums

log = logging.getLogger(__name__)

CHUNK = 32 << 20  # bytes between writeback starts
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* (linux/fs.h)
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP}


def _load_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def save_streamed(obj: Any, f: BinaryIO, chunk: int = CHUNK, **save_kwargs: Any) -> None:
    """``torch.save(obj, **save_kwargs)`` into the open binary file ``f`` (a new file, by name)
    through a :class:`WritebackStream`, its checksum recorded (lmtrain.checkpoint.checksums); a write that
    failed raises its own ``OSError`` (no space, EIO), not torch's RuntimeError."""
    import torch

    stream = WritebackStream(f, chunk)
    try:
        with _no_zip_crc32(torch):
            torch.save(obj, stream, **save_kwargs)
    except Exception as exc:
        if stream.error is not None:
            raise stream.error from exc
        raise
    stream.record()


_crc_lock = threading.Lock()
_crc_writers = 0  # saves under way without the CRC32 (the setting is the process's, not the thread's)
_crc_before = True  # the setting the first of them found


@contextlib.contextmanager
def _no_zip_crc32(torch: Any) -> Iterator[None]:
    """torch.save's CRC32 off while any checkpoint file is being written, then as it was (a torch without
    the setting computes it as before)."""
    global _crc_writers, _crc_before
    setter = getattr(torch.serialization, "set_crc32_options", None)
    getter = getattr(torch.serialization, "get_crc32_options", None)
    if setter is None or getter is None:
        yield
        return
    with _crc_lock:
        if _crc_writers == 0:
            _crc_before = getter()
        _crc_writers += 1
        setter(False)
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0:
                setter(_crc_before)


class WritebackStream:
    """A write-only file object over ``f`` (a binary file opened for writing at offset 0) for ``torch.save``: writes pass
    through, and every ``chunk`` bytes the writeback of the newest chunk starts and the one
    before it is waited for and dropped from the page cache. The caller still fsyncs."""

    def __init__(self, f: BinaryIO, chunk: int = CHUNK) -> None:
        self.f, self.chunk = f, chunk
        self.fd = f.fileno()
        self.pos = 0  # bytes written
        self.started = 0  # writeback started for [0, started)
        self.done = 0  # written back and dropped: [0, done)
        self.streaming = _sync_file_range is not None
        self.error: OSError | None = None  # torch.save reports a failed write as its own RuntimeError
        self.hasher = checksums.new_hasher()  # the file's checksum, from the bytes as they pass

    def record(self) -> None:
        """The file is whole: its size and checksum to lmtrain.checkpoint.checksums (by the file's name)."""
        checksums.record(self.f.name, self.pos, self.hasher.hexdigest())

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size, off = len(view), 0
        while off < size:
            # pieces that end on chunk boundaries: a chunk is handed to writeback as soon as it is
            # whole (one 150 MB tensor written at once would otherwise leave all of it cached)
            piece = min(size - off, self.chunk - (self.pos - self.started)) if self.streaming else size - off
            self.f.write(view[off:off + piece])
            self.hasher.update(view[off:off + piece])
            self.pos += piece
            off += piece
            self._writeback()
        return size

    def _writeback(self) -> None:
        while self.streaming and self.pos - self.started >= self.chunk:
            self.f.flush()
            self._range(self.started, _WRITE)
            if self.streaming and self.started - self.done >= self.chunk:
                self._range(self.done, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
                os.posix_fadvise(self.fd, self.done, self.chunk, os.POSIX_FADV_DONTNEED)
                self.done += self.chunk
            self.started += self.chunk

    def flush(self) -> None:
        self.f.flush()

    def _range(self, offset: int, flags: int) -> None:
        if _sync_file_range(self.fd, offset, self.chunk, flags) == 0:
            return
        err = ctypes.get_errno()
        if err in _UNSUPPORTED:
            log.info("sync_file_range is not supported here (%s): writing without early writeback", os.strerror(err))
            self.streaming = False
            return
        raise OSError(err, os.strerror(err), getattr(self.f, "name", None))
