"""lmcore.atomic: a whole-file write is seen old or new; a temporary file that a writer killed between
its write and its rename left behind goes at the next write of the same file, once it is old enough
that no live writer (on any node of a shared filesystem) can still be renaming it."""

from __future__ import annotations

import os
import time

from lmcore.atomic import ABANDONED_S, write_atomic


def test_a_temporary_file_a_killed_writer_left_goes_at_the_next_write(tmp_path):
    target = tmp_path / "rank-times.json"
    old = tmp_path / ".rank-times.json.21078.tmp"  # a rank killed mid-write (seen in a chaos campaign)
    old.write_text("{")
    past = time.time() - ABANDONED_S - 5
    os.utime(old, (past, past))
    fresh = tmp_path / ".rank-times.json.999999.tmp"  # another node's writer, right now
    fresh.write_text("{")
    other = tmp_path / ".other.json.21078.tmp"
    other.write_text("{")
    os.utime(other, (past, past))
    write_atomic(target, '{"ok": 1}')
    assert target.read_text() == '{"ok": 1}'
    assert not old.exists() and fresh.exists() and other.exists()  # only this file's, only the old
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.21078.tmp", ".rank-times.json.999999.tmp",
                                                         "rank-times.json"]
