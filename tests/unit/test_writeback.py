"""The checkpoint file stream (lmtrain.checkpoint.writeback): the same bytes as a plain torch.save, the
page cache dropped behind it, and sync_file_range's errors handled as a write's."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from lmtrain.checkpoint import writeback
from lmtrain.checkpoint.writeback import WritebackStream, save_streamed
from tests.waiting import until


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300_001, generator=g), "opt": {"m": torch.randn(70_000, generator=g), "step": 7},
            "tied": [torch.arange(10)] * 2, "name": "x"}


def _cached_pages(path) -> int | None:
    """Resident pages of ``path`` in the page cache (mincore over a mapping), None if unknown."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        addr = ctypes.c_void_p.from_buffer(m)  # type: ignore[arg-type]
        ok = libc.mincore(ctypes.c_void_p(ctypes.addressof(addr)), ctypes.c_size_t(size), vec) == 0
        del addr
        return sum(v & 1 for v in vec) if ok else None
    except (OSError, TypeError, ValueError):
        return None
    finally:
        m.close()


@pytest.mark.parametrize("chunk", [4096, 1 << 16, 1 << 30])
def test_stream_writes_the_same_file_as_a_plain_save(tmp_path, chunk):
    state = _state()
    plain, streamed = tmp_path / "plain.pt", tmp_path / "streamed.pt"
    with open(plain, "wb") as f:
        torch.save(state, f)
    with open(streamed, "wb") as f:
        s = WritebackStream(f, chunk=chunk)
        torch.save(state, s)
    assert plain.read_bytes() == streamed.read_bytes()
    back = torch.load(streamed, weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["opt"]["step"] == 7
    assert back["tied"][0].untyped_storage().data_ptr() == back["tied"][1].untyped_storage().data_ptr()
    if chunk < os.path.getsize(streamed) // 4 and writeback._sync_file_range is not None:
        assert s.streaming and s.done >= s.pos - 2 * chunk - 1  # every chunk but the last two written back


@pytest.mark.skipif(writeback._sync_file_range is None, reason="sync_file_range is Linux's")
def test_written_back_chunks_leave_the_page_cache(tmp_path):
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        s = WritebackStream(f, chunk=1 << 20)
        torch.save({"x": torch.zeros(8 << 20)}, s)  # 32 MiB
    cached = _cached_pages(path)
    if cached is None:
        pytest.skip("mincore unavailable")
    total = os.path.getsize(path) // 4096
    assert cached <= total // 4, f"{cached} of {total} pages still cached"


def test_refused_sync_file_range_falls_back_to_plain_writes(tmp_path, monkeypatch):
    calls = []

    def refuse(fd, offset, length, flags):
        calls.append(flags)
        import ctypes

        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(writeback, "_sync_file_range", refuse)
    path = tmp_path / "x.pt"
    with open(path, "wb") as f:
        s = WritebackStream(f, chunk=4096)
        torch.save(_state(), s)
    assert calls == [writeback._WRITE] and not s.streaming  # tried once, then plain
    assert torch.equal(torch.load(path, weights_only=True)["w"], _state()["w"])


def test_a_writeback_error_is_raised_as_the_write_error_it_is(tmp_path, monkeypatch):
    from lmtrain.checkpoint.disk_space import is_no_space

    def full(fd, offset, length, flags):
        import ctypes

        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(writeback, "_sync_file_range", full)
    with open(tmp_path / "x.pt", "wb") as f, pytest.raises(OSError) as info:
        save_streamed(_state(), f, chunk=4096)
    assert info.value.errno == errno.ENOSPC and is_no_space(info.value)


def test_checkpoint_files_are_saved_without_the_zips_crc32_and_load_the_same(tmp_path):
    """save_streamed leaves torch.save's CRC32 out (the manifest's checksum covers the file) and the
    process's setting as it found it; torch.load reads the file as it reads one with the CRC."""
    import zipfile

    state = _state()
    # a background checkpoint writer of an earlier test may still be writing (the setting is the process's)
    until(lambda: writeback._crc_writers == 0, progress=lambda: sum(1 for t in threading.enumerate() if t.is_alive()),
          what="earlier tests' checkpoint writers to finish")
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    with_crc, without = tmp_path / "crc.pt", tmp_path / "nocrc.pt"
    with open(with_crc, "wb") as f:
        torch.save(state, f)
    with open(without, "wb") as f:
        save_streamed(state, f)
    assert torch.serialization.get_crc32_options() is True
    torch.serialization.set_crc32_options(before)
    crcs = {i.filename: i.CRC for i in zipfile.ZipFile(with_crc).infolist()}
    no_crcs = {i.filename: i.CRC for i in zipfile.ZipFile(without).infolist()}
    assert crcs.keys() == no_crcs.keys() and any(crcs.values()) and not any(no_crcs.values())
    back = torch.load(without, weights_only=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["opt"]["m"], state["opt"]["m"])
