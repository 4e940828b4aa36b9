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


def test_an_attempt_start_clears_what_killed_writers_of_earlier_attempts_left_and_nothing_else(tmp_path):
    """A rank SIGKILLed while it rewrote metrics/rank-times.json left its temporary, and the run then
    completed within ABANDONED_S (no later write of that file was old enough to clear it: a chaos replay
    found it in a completed run). The next attempt's rank 0 (lmtrain.task.training._drop_abandoned)
    removes the temporaries older than the last attempt's end line, outside checkpoints/, code/, eval/."""
    import json
    from types import SimpleNamespace

    from lmcore.atomic import drop_abandoned_under
    from lmtrain.task.training import _drop_abandoned

    run = tmp_path / "run"
    for d in ("metrics", "logs/attempt-2", "checkpoints/step-50", "eval"):
        (run / d).mkdir(parents=True)
    killed = run / "metrics" / ".rank-times.json.4181.tmp"
    deep = run / "logs" / "attempt-2" / ".environment.json.77.tmp"
    ckpt = run / "checkpoints" / "step-50" / ".meta.json.4181.tmp"  # the checkpoints' protocol prunes these
    live = run / "eval" / ".state.json.55.tmp"  # the evaluator outlives attempts: never ours to take
    named = run / "metrics" / ".notes.tmp"  # not write_atomic's name
    for f in (killed, deep, ckpt, live, named):
        f.write_text("{")
    end = time.time()
    later = run / "metrics" / ".rank-times.json.5000.tmp"  # written after the end line: a live writer's
    later.write_text("{")
    os.utime(later, (end + 5, end + 5))
    ledger = run / "attempts.jsonl"
    ledger.write_text(json.dumps({"event": "end", "attempt": 2, "time": end + 1}) + "\n")
    plan = SimpleNamespace(paths=SimpleNamespace(ledger=str(ledger), run_dir=str(run)))
    _drop_abandoned(plan, attempt=1)  # a first attempt: nothing before it
    assert killed.exists()
    _drop_abandoned(plan, attempt=3)
    assert not killed.exists() and not deep.exists()
    assert ckpt.exists() and live.exists() and named.exists() and later.exists()
    assert drop_abandoned_under(run, end + 1, skip=("checkpoints", "eval")) == []  # nothing more of its kind
