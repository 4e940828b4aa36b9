"""The caches behind `lmlaunch status` over many runs: rows built from the cached copy of a run
directory equal rows built from a full reading; unchanged run directories and registry entries
are not read again; any change (heartbeat line, ledger line, new checkpoint, DONE/CANCELLED
marker, replaced registry entry) is seen on the next call; files changed within the racy window
are never cached; a corrupt cache costs one full reading, never a wrong row."""

from __future__ import annotations

import json
import os
import random
import stat
import time
from pathlib import Path

import pytest
from monitor_synth import make_run, write_jsonl

from launcher.monitor import run_files, status_cache, status_rows as monitor
from launcher.monitor.run_files import RunFiles
from launcher.monitor.slurm_view import SlurmJob
from launcher.runs import registry as runs

NOW = time.time()
ATTEMPT = {"job_id": "11", "start_step": 0, "end_step": 50, "t0": NOW - 3000, "t1": NOW - 2000, "reason": "completed"}


def _age(path: Path, seconds: float = 60.0) -> None:
    """Every file under ``path`` (and the directory itself) last changed ``seconds`` ago."""
    t = time.time() - seconds
    for root, dirs, files in os.walk(path):
        for n in files + dirs:
            os.utime(os.path.join(root, n), (t, t), follow_symlinks=False)
    os.utime(path, (t, t))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMLAUNCH_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Run directories status_cache read in full."""
    seen: list[str] = []
    real = status_cache.read_run_files

    def counting(run_dir, **kw):
        seen.append(str(run_dir))
        return real(run_dir, **kw)

    monkeypatch.setattr(status_cache, "read_run_files", counting)
    return seen


def _runs(home: Path, n: int = 5) -> list[str]:
    dirs = [str(make_run(home, f"r{i}", job_ids=("11",), checkpoint_step=40, attempts=[ATTEMPT])) for i in range(n)]
    _age(home)
    return dirs


def _rows(dirs: list[str], files: list[RunFiles], job: SlurmJob | None = None) -> list[dict]:
    out = []
    for d, f in zip(dirs, files):
        rec = runs.RunRecord(name=Path(d).name, profile="local", run_dir=d, spec_path=None, job_ids=["11"],
                             submitted_at=[NOW - 3600], max_steps=100)
        out.append(monitor.build_row(rec, f, job, slurm_reachable=True, now=NOW).to_dict())
    return out


def test_a_second_call_reads_no_unchanged_run_directory_and_gives_the_same_rows(home, reads):
    dirs = _runs(home)
    first = status_cache.read_all(dirs)
    assert sorted(reads) == sorted(dirs)
    reads.clear()
    second = status_cache.read_all(dirs)
    assert reads == []
    full = [run_files.read_run_files(Path(d), with_plan_time=True) for d in dirs]
    running = SlurmJob("11", "RUNNING", "None", 1, "1:00:00", 2, "5:00", "n[1-2]")
    for job in (None, running):
        assert _rows(dirs, second, job) == _rows(dirs, full, job) == _rows(dirs, first, job)
    mode = stat.S_IMODE(os.stat(home / status_cache.CACHE_FILE).st_mode)
    assert mode == 0o600


@pytest.mark.parametrize("change", ["heartbeat", "ledger", "checkpoint", "DONE", "CANCELLED", "removed"])
def test_any_change_to_a_run_directory_is_seen_on_the_next_call(home, reads, change):
    dirs = _runs(home, 3)
    status_cache.read_all(dirs)
    d = Path(dirs[1])
    if change == "heartbeat":
        write_jsonl(d / "metrics" / "heartbeat.jsonl", [{"time": NOW, "event": "step", "step": 60, "max_steps": 100,
                                                         "loss": 1.5, "attempt": 1}])
    elif change == "ledger":
        write_jsonl(d / "attempts.jsonl", [{"event": "start", "attempt": 2, "job_id": "12"}])
    elif change == "checkpoint":
        (d / "checkpoints" / "step-50").mkdir()
        (d / "checkpoints" / "step-50" / "COMPLETE").write_text("")
        tmp = d / "checkpoints" / ".latest.tmp"
        tmp.write_text("step-50\n")
        os.replace(tmp, d / "checkpoints" / "latest")
    elif change in ("DONE", "CANCELLED"):
        (d / change).write_text("x\n")
    else:
        import shutil

        shutil.rmtree(d)
    reads.clear()
    got = status_cache.read_all(dirs)
    assert reads == [dirs[1]]
    expect = run_files.read_run_files(d, with_plan_time=True)
    assert _rows(dirs[1:2], got[1:2]) == _rows(dirs[1:2], [expect])
    if change == "heartbeat":
        assert got[1].heartbeat[-1]["step"] == 60
    elif change == "checkpoint":
        assert got[1].checkpoint.step == 50
    elif change == "removed":
        assert got[1].exists is False
    elif change != "ledger":
        assert getattr(got[1], change.lower()) is True


def test_a_run_directory_changed_within_the_racy_window_is_read_every_time(home, reads):
    d = str(make_run(home, "busy", job_ids=("11",), attempts=[ATTEMPT]))  # just written
    status_cache.read_all([d])
    status_cache.read_all([d])
    assert reads == [d, d]


def test_a_corrupt_or_foreign_cache_costs_one_full_reading(home, reads):
    dirs = _runs(home, 2)
    path = home / status_cache.CACHE_FILE
    for junk in ("{not json", '{"version": 99, "runs": {}}', '{"version": 1, "runs": {"' + dirs[0] + '": {"id": 1}}}'):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(junk)
        reads.clear()
        got = status_cache.read_all(dirs)
        assert sorted(reads) == sorted(dirs)
        assert all(f.checkpoint and f.checkpoint.step == 40 for f in got)
    # an entry whose identity matches but whose copy is damaged is read afresh
    data = json.loads(path.read_text())
    data["runs"][dirs[0]]["files"] = {"heartbeat": 3}
    path.write_text(json.dumps(data))
    reads.clear()
    assert status_cache.read_all(dirs)[0].checkpoint.step == 40
    assert reads == [dirs[0]]


def test_status_of_one_run_keeps_the_other_entries_while_their_directories_exist(home, reads):
    dirs = _runs(home, 3)
    status_cache.read_all(dirs)
    status_cache.read_all(dirs[:1])
    reads.clear()
    status_cache.read_all(dirs)
    assert reads == []
    os.rename(dirs[2], dirs[2] + ".archived-20261123")  # `submit --new` archives the old directory
    status_cache.read_all(dirs[:1])
    cached = json.loads((home / status_cache.CACHE_FILE).read_text())["runs"]
    assert sorted(cached) == sorted(dirs[:2])


def test_the_compact_heartbeat_gives_the_row_of_the_full_tail():
    """Random heartbeat tails (several attempts, missing keys, restarts at lower steps, start and
    end events): the kept lines give build_row's answer for every field."""
    rng = random.Random(7)
    rec = runs.RunRecord(name="r", profile="local", run_dir="/nonexistent", spec_path=None, job_ids=["11"],
                         submitted_at=[NOW], max_steps=100)
    running = SlurmJob("11", "RUNNING", "None", 1, "1:00:00", 2, "5:00", "n[1-2]")
    for _ in range(300):
        beats, t, step = [], NOW - 1000, 0
        for _ in range(rng.randint(0, 25)):
            t += rng.uniform(0, 10)
            kind = rng.choice(["step", "step", "step", "start", "end", "checkpoint"])
            b = {"time": t, "event": kind, "attempt": rng.choice([1, 2, 2, 3]), "noise": rng.random()}
            if rng.random() < 0.9:
                step = max(0, step + rng.randint(-5, 10))
                b["step"] = step
            if rng.random() < 0.7:
                b["max_steps"] = rng.choice([100, 200])
            for k in ("loss", "tokens_per_s", "mfu"):
                if rng.random() < 0.8:
                    b[k] = rng.random()
            if rng.random() < 0.05:
                del b["time"]
            beats.append(b)
        full = RunFiles(heartbeat=beats)
        small = RunFiles(heartbeat=status_cache.compact_heartbeat(beats))
        for job in (None, running):
            a = monitor.build_row(rec, full, job, slurm_reachable=True, now=NOW)
            b = monitor.build_row(rec, small, job, slurm_reachable=True, now=NOW)
            assert a == b, beats


# --------------------------------------------------------------------------- the registry index


def _record(name: str, home: Path, **kw) -> runs.RunRecord:
    rec = runs.RunRecord(name=name, profile="local", run_dir=str(home / "runs" / name), spec_path=None,
                         job_ids=kw.get("job_ids", ["1"]), submitted_at=[NOW], max_steps=10)
    runs.save_record(rec)
    return rec


def test_the_registry_index_follows_every_change_to_the_entries(home, monkeypatch):
    for i in range(4):
        _record(f"run{i}", home)
    _age(home / "registry")
    assert [r.name for r in runs.list_records()] == ["run0", "run1", "run2", "run3"]
    index = home / runs.REGISTRY_INDEX
    assert index.exists() and stat.S_IMODE(index.stat().st_mode) == 0o600

    opened: list[str] = []
    real_open = open

    def counting_open(path, *a, **kw):
        if str(path).startswith(str(home / "registry")):
            opened.append(str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", counting_open)
    assert [r.name for r in runs.list_records()] == ["run0", "run1", "run2", "run3"]
    assert opened == []  # all from the index

    _record("run1", home, job_ids=["1", "2"])  # resubmitted: a replaced entry
    runs.delete_record("run2")
    _record("run4", home)
    (home / "registry" / "broken.json").write_text("{nope")
    got = {r.name: r for r in runs.list_records()}
    assert sorted(got) == ["run0", "run1", "run3", "run4"]
    assert got["run1"].job_ids == ["1", "2"]
    assert sorted(Path(p).name for p in opened) == ["broken.json", "run1.json", "run4.json"]


def test_a_checkpoint_completing_outside_the_run_directory_is_seen(home, reads):
    """checkpoint.dir elsewhere (the plan says where): its directory is watched too."""
    dirs = _runs(home, 2)
    outside = home / "elsewhere" / "ckpts"
    (outside / "step-70").mkdir(parents=True)
    (outside / "step-70" / "COMPLETE").write_text("")
    (Path(dirs[0]) / "plan.json").write_text(json.dumps({"paths": {"checkpoint_dir": str(outside)}}))
    _age(home)
    assert status_cache.read_all(dirs)[0].checkpoint.step == 70
    reads.clear()
    assert status_cache.read_all(dirs)[0].checkpoint.step == 70 and reads == []
    (outside / ".step-80.tmp").mkdir()
    (outside / ".step-80.tmp" / "COMPLETE").write_text("")
    os.replace(outside / ".step-80.tmp", outside / "step-80")  # how a save finishes: a rename
    got = status_cache.read_all(dirs)
    assert reads == [dirs[0]] and got[0].checkpoint.step == 80
