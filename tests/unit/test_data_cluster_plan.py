"""`data prepare --on-cluster` before anything is queued: the slices, the scripts (bash -n), and the
arguments that reach the job scripts held to the job spec's rules, refused with nothing left behind."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.submit.data_cluster import slices
from launcher.submit.script import ArrayJob, array_script, assemble_script


def test_slices_are_contiguous_cover_every_file_and_are_never_empty():
    assert slices(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert slices(5, 2) == [(0, 2), (2, 5)]
    assert slices(2, 8) == [(0, 1), (1, 2)]  # more tasks than files: one file each


def test_the_scripts_are_valid_bash_and_throttle_the_array(tmp_path):
    job = ArrayJob("prep", "/runs/prep dir", "low", "01:00:00", 2, "/venv/bin/python", "acct", None)
    rendered = array_script(job, range(4), 2)
    script = rendered.text
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --account=acct" in script
    assert "exec srun --ntasks=1 /venv/bin/python -m lmtrain.data.prepare.array_task '/runs/prep dir' \"$SLURM_ARRAY_TASK_ID\"" in script
    # the header is written from the job's options (what slurmrestd is sent), quoted as sbatch reads it
    assert "#SBATCH --chdir='/runs/prep dir'" in script and ("chdir", "/runs/prep dir") in rendered.options
    assert ("requeue", "") in rendered.options and ("qos", None) not in rendered.options
    for text in (script, assemble_script(job).text):
        (tmp_path / "s.sh").write_text(text)
        assert subprocess.run(["bash", "-n", str(tmp_path / "s.sh")]).returncode == 0


def test_what_reaches_the_job_scripts_is_checked_before_anything_is_made(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    env = {"LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "HOME": str(tmp_path)}

    def run(*extra: str) -> tuple[int, str]:
        err = io.StringIO()
        code = main(["data", "prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--on-cluster",
                     *extra], Context(stdout=io.StringIO(), stderr=err, environ=env))
        return code, err.getvalue()

    code, err = run("--time", "1:00:00\nrm -rf /")
    assert code == 2 and "is not a SLURM time" in err, err
    code, err = run("--name", "a b;x")
    assert code == 2 and "--name 'a b;x' is not a valid run name" in err, err
    code, err = run("--time", "5-00:00:00")
    assert code == 2 and "--time 5-00:00:00 = 7200 min is above partition 'low' max_time" in err, err
    code, err = run("--array-size", "0")
    assert code == 2 and "--array-size 0: must be 1..1001 (the cluster's MaxArraySize" in err, err
    code, err = run("--tasks", "0")
    assert code == 2 and "--tasks(0)" in err, err
    assert not Path(tmp_path / "runs").exists() and not (tmp_path / "out.partial").exists()


def test_a_later_array_numbers_its_tasks_after_those_before_it(tmp_path):
    job = ArrayJob("prep", "/runs/prep", "low", "01:00:00", 1, "/venv/bin/python")
    script = array_script(job, range(4, 6), 2).text
    assert "#SBATCH --array=0-1%2" in script and '"$((SLURM_ARRAY_TASK_ID + 4))"' in script
    (tmp_path / "s.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "s.sh")]).returncode == 0
    got = subprocess.run(["bash", "-c", 'SLURM_ARRAY_TASK_ID=1; echo "$((SLURM_ARRAY_TASK_ID + 4))"'],
                         capture_output=True, text=True).stdout
    assert got.strip() == "5"


def test_chained_arrays_cover_every_task_and_a_failed_submission_cancels_those_queued(monkeypatch):
    from launcher.submit import arrays
    from lmcore.slurm import client as slurm

    assert arrays.chunks(5, 2) == [range(0, 2), range(2, 4), range(4, 5)] and arrays.chunks(3, 10) == [range(0, 3)]
    calls, cancelled = [], []

    def submit(part: range, dependency: str | None) -> str:
        if len(calls) == 2:
            raise RuntimeError("sbatch: error: QOSMaxSubmitJobPerUserLimit")
        calls.append((part, dependency))
        return str(100 + len(calls))

    assert arrays.submit_chained(3, 2, lambda p, d: (calls.append((p, d)), str(len(calls)))[1]) == ["1", "2"]
    assert calls == [(range(0, 2), None), (range(2, 3), "afterany:1")]
    calls.clear()
    monkeypatch.setattr(slurm, "cancel", lambda ids, **k: cancelled.extend(ids))
    with pytest.raises(RuntimeError, match="QOSMaxSubmitJobPerUserLimit"):
        arrays.submit_chained(5, 2, submit)
    assert cancelled == ["101", "102"]  # all or nothing
