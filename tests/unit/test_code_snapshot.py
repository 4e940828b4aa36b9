"""Every attempt of a run runs the code it was submitted with: the run's code snapshot
(launcher.runs.snapshot), first on PYTHONPATH and in the tasks' working directory; a resume after the
code changed says what changed and takes the new code only with --new-code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.monitor import diff
from launcher.planning.resolve import resolve
from launcher.runs import snapshot
from launcher.submit import lifecycle
from lmcore.errors import UserError


def _plan(repo, root: Path, *overrides: str):
    environ = {"LMLAUNCH_RUNS_ROOT": str(root), "HOME": "/home/u", "USER": "u"}
    return resolve(str(repo / "jobs" / "tiny-cpu.yaml"), list(overrides), cluster="local", environ=environ).plan


def _pretend_the_code_changed(run_dir: Path, rel: str = "lmtrain/model/module.py") -> None:
    """Make the snapshot's record of one file differ from the checkout (as an edit would)."""
    manifest = run_dir / "code" / "manifest.json"
    d = json.loads(manifest.read_text())
    d["files"][rel] = "0" * 64
    manifest.write_text(json.dumps(d))


def test_a_new_run_holds_its_code_and_the_plan_runs_it(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    opening = lifecycle.plan_opening(plan)
    opening.apply()
    run_dir = Path(plan.paths.run_dir)
    snap = snapshot.read(run_dir)
    assert snap is not None and "lmtrain/task/entry.py" in snap.files and "lmcore/job/plan.py" in snap.files
    assert (run_dir / "code" / "lmtrain" / "task" / "entry.py").read_bytes() == (repo / "src" / "lmtrain" / "task" / "entry.py").read_bytes()
    assert not list((run_dir / "code").rglob("__pycache__"))
    assert snap.size < 5e6 and snap.git is not None and len(str(snap.git["commit"])) == 40
    assert any("code snapshot" in n for n in opening.notes)
    assert plan.env["PYTHONPATH"] == f"{run_dir}/code/lmlaunch-code.zip"  # first: the snapshot's zip
    import zipfile

    with zipfile.ZipFile(run_dir / "code" / "lmlaunch-code.zip") as zf:
        names = set(zf.namelist())
    assert names == set(snap.files) | {rel[:-3] + ".pyc" for rel in snap.files if rel.endswith(".py")}
    from launcher.submit.script import executor_parameters

    assert executor_parameters(plan)["additional_parameters"]["chdir"] == str(run_dir)


def test_a_resume_of_a_snapshot_taken_before_the_zip_zips_its_own_files(repo, tmp_path):
    """The plan imports the snapshot's zip: a run whose snapshot has none (taken before it existed)
    gets one of its own files at its resume, not of the current code; undone when the submission is."""
    import zipfile

    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    code = run_dir / "code"
    (code / "lmlaunch-code.zip").unlink()
    (code / "lmtrain" / "model" / "module.py").write_text("# the run's own, older module\n")  # as it was then
    opening = lifecycle.plan_opening(plan, resume=True)  # the manifest is unchanged: no --new-code needed
    opening.apply()
    with zipfile.ZipFile(code / "lmlaunch-code.zip") as zf:
        assert zf.read("lmtrain/model/module.py") == b"# the run's own, older module\n"
        assert "lmtrain/model/module.pyc" in zf.namelist()
    assert not list(code.glob(".*.tmp"))
    opening.rollback()
    assert not (code / "lmlaunch-code.zip").exists()
    assert snapshot.add_zip(run_dir) and not snapshot.add_zip(run_dir)  # made once, then kept


def test_a_resume_after_the_code_changed_needs_new_code_and_says_what_changed(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    lifecycle.plan_opening(plan, resume=True).apply()  # unchanged code: resumes on its own snapshot
    _pretend_the_code_changed(run_dir)
    with pytest.raises(UserError, match=r"(?s)the code changed since:\n  changed lmtrain/model/module.py.*--new-code"):
        lifecycle.plan_opening(plan, resume=True)
    before = (run_dir / "code" / "manifest.json").read_text()
    opening = lifecycle.plan_opening(plan, resume=True, new_code=True)
    opening.apply()
    assert any("--new-code" in n and "changed lmtrain/model/module.py" in n for n in opening.notes)
    assert snapshot.read(run_dir).files == snapshot.current()[0].files  # the current code now
    opening.rollback()  # e.g. sbatch refused: the run keeps the code it had
    assert (run_dir / "code" / "manifest.json").read_text() == before
    with pytest.raises(UserError, match="--new-code goes with --resume"):
        lifecycle.plan_opening(_plan(repo, tmp_path, "name=other"), new_code=True)


def test_the_zip_is_imported_from_its_bytecode_or_else_its_source(tmp_path):
    """A module of the snapshot's zip runs from the bytecode beside it, compiled once naming the
    snapshot directory's copy of its file and never checked against the source (the zip is never changed); bytecode of another
    Python (its magic number) is passed over for the source. A data file read by path is found in
    the directory beside the zip (lmcore.run.rundir.unzipped)."""
    import subprocess
    import sys
    import zipfile

    from lmcore.run.rundir import unzipped

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "m.py").write_text("X = 'source'\ndef where():\n    raise ValueError('from m')\n")
    (src / "pkg" / "data.txt").write_text("beside")
    files = {rel: src / rel for rel in ("pkg/__init__.py", "pkg/m.py", "pkg/data.txt")}
    final = tmp_path / "code"
    final.mkdir()
    made = src / "lmlaunch-code.zip"
    snapshot.write_zip(made, files, final)

    def rebuilt(name: str, source: bytes, pyc_magic: bytes | None = None) -> Path:
        """The zip with m.py's source replaced (its bytecode kept, or given another magic number)."""
        out = tmp_path / name / "lmlaunch-code.zip"
        out.parent.mkdir()
        with zipfile.ZipFile(made) as zin, zipfile.ZipFile(out, "w") as zout:
            for info in zin.infolist():
                data = zin.read(info)
                if info.filename == "pkg/m.py":
                    data = source
                elif info.filename == "pkg/m.pyc" and pyc_magic is not None:
                    data = pyc_magic + data[4:]
                zout.writestr(info, data)
        return out

    probe = ("import pkg.m, traceback\nprint(pkg.m.X, pkg.m.__file__)\n"
             "try:\n    pkg.m.where()\nexcept ValueError:\n    print(traceback.format_exc())")
    edited = b"X = 'edited'\ndef where():\n    raise ValueError('edited')\n"
    for zipped, want in ((rebuilt("bytecode", edited), "source"), (rebuilt("other-python", edited, b"\x00\x00\r\n"), "edited")):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env={"PYTHONPATH": str(zipped)},
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        value, path = out.stdout.split("\n")[0].split()
        assert value == want and path == f"{zipped}/pkg/m.py{'c' if want == 'source' else ''}", out.stdout
    made_here = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                               env={"PYTHONPATH": str(made)}).stdout
    # the traceback names the file as the snapshot's directory holds it, its line read from the zip (no file there here)
    assert f'File "{final}/pkg/m.py", line 3, in where' in made_here, made_here
    assert "raise ValueError('from m')" in made_here
    assert unzipped(f"{final}/lmlaunch-code.zip/pkg/data.txt") == final / "pkg" / "data.txt"
    assert unzipped("/a/b/c.txt") == Path("/a/b/c.txt")


def test_diff_names_the_files_that_differ(repo, tmp_path):
    a, b = _plan(repo, tmp_path, "name=a"), _plan(repo, tmp_path, "name=b")
    for p in (a, b):
        lifecycle.plan_opening(p).apply()
    _pretend_the_code_changed(Path(b.paths.run_dir), "lmtrain/data/loader.py")
    found = diff.diff_runs(diff.read_run("a", Path(a.paths.run_dir)), diff.read_run("b", Path(b.paths.run_dir)))
    assert [(d.section, d.key) for d in found] == [("code", "files.lmtrain/data/loader.py")]


@pytest.mark.slow
def test_the_tasks_import_the_snapshot_not_the_checkout(repo, runs_root):
    """Change the run's snapshot (not the checkout): the trained steps carry the change, and the
    environment record says the code came from the snapshot."""
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch

    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), ["trainer.limit_val_batches=0"], devices=1,
                             max_steps=2, name="snap", environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)},
                             say=lambda *_: None)
    run_dir = Path(plan.paths.run_dir)
    callbacks = run_dir / "code" / "lmtrain" / "observe" / "callbacks.py"
    text = callbacks.read_text()
    marked = text.replace('self.heartbeat.emit("step", max_steps=max_steps, **metrics)',
                          'self.heartbeat.emit("step", max_steps=max_steps, snapshot_marker=1, **metrics)')
    assert marked != text
    callbacks.write_text(marked)
    code_dir = run_dir / "code"  # the processes import the zip: it is made again from the edited directory
    zipped = code_dir / "lmlaunch-code.zip"
    snapshot.write_zip(zipped, {rel: code_dir / rel for rel in snapshot.read(run_dir).files}, code_dir)
    with open(run_dir / "launcher.out", "w") as out:
        assert launch(plan.paths.run_dir, 1, plan_env=plan.env, out=out, threads_per_proc=1) == 0
    steps = [json.loads(x) for x in (run_dir / "metrics" / "heartbeat.jsonl").read_text().splitlines()]
    steps = [x for x in steps if x["event"] == "step"]
    assert steps and all(x.get("snapshot_marker") == 1 for x in steps), steps
    code = json.loads((run_dir / "logs" / "attempt-1" / "environment.json").read_text())["code"]
    assert code["from_snapshot"] is True
    assert code["lmtrain"] == str(run_dir.resolve() / "code" / "lmlaunch-code.zip" / "lmtrain"), code


def test_a_modules_bytecode_is_compiled_once_and_named_for_each_runs_directory(tmp_path, monkeypatch):
    """launcher.runs.bytecode_cache: the second zip of the same sources compiles nothing, and every
    code object in it (functions, classes, comprehensions) names the second run's file."""
    import marshal
    import os
    import time
    import zipfile

    from launcher.runs import bytecode_cache

    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "m.py").write_text("class C:\n    def f(self):\n        return [x for x in (1, 2)]\n")
    files, cache = {"pkg/m.py": src / "m.py"}, tmp_path / "cache"
    snapshot.write_zip(tmp_path / "a.zip", files, tmp_path / "run-a" / "code", cache=cache)
    assert len(list(cache.glob("*.marshal"))) == 1

    def no_compile(*_a, **_k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(bytecode_cache, "compile", no_compile, raising=False)
    snapshot.write_zip(tmp_path / "b.zip", files, tmp_path / "run-b" / "code", cache=cache)
    with zipfile.ZipFile(tmp_path / "b.zip") as zf:
        code = marshal.loads(zf.read("pkg/m.pyc")[16:])

    def names(c):
        yield c.co_filename
        for k in c.co_consts:
            if hasattr(k, "co_filename"):
                yield from names(k)

    assert set(names(code)) == {str(tmp_path / "run-b" / "code" / "pkg" / "m.py")} and len(list(names(code))) == 4
    old = next(cache.glob("*.marshal"))
    os.utime(old, (time.time() - 31 * 86400,) * 2)  # unused for a month: an older checkout's
    assert bytecode_cache.prune(cache) == 1 and not list(cache.glob("*.marshal"))
