"""lmtrain.task.main, what srun starts in every SLURM task: lmtrain's record-only handlers for the
warning signal and SIGTERM are installed before anything else (before submitit's runner imports
numpy and waits for and unpickles the task), stay installed for lmtrain's task, and keep what
they recorded for the entry; any other callable gets submitit's handlers as under
``submitit.core._submit``. Real processes and real signals, with the submitit folder laid out
as sbatch leaves it."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import waiting
from submitit.core.utils import DelayedSubmission
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

REPO = Path(__file__).resolve().parents[2]
JOB = "4242"


def _start(folder: Path, runner: list[str], tmp_path: Path, rank: int = 0) -> subprocess.Popen:
    env = {**os.environ, "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": JOB, "SLURM_PROCID": str(rank),
           "SLURM_NTASKS": str(rank + 1), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
           "SLURM_JOB_NUM_NODES": str(rank + 1),
           "SLURM_JOB_NODELIST": "n1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    env.pop("SUBMITIT_PREEMPT_SIGNAL", None)
    return subprocess.Popen([sys.executable, "-u", *runner, str(folder)], env=env, cwd=tmp_path,
                            stdout=open(tmp_path / "out", "wb"), stderr=open(tmp_path / "err", "wb"))


def _output(tmp_path: Path) -> str:
    return (tmp_path / "out").read_text(errors="replace") + (tmp_path / "err").read_text(errors="replace")


def _caught(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    return set()


def _wait_caught(proc: subprocess.Popen, signums: set[int]) -> None:
    def caught() -> bool:
        assert proc.poll() is None, f"the task process exited with {proc.returncode}"
        return signums <= _caught(proc.pid)

    waiting.until(caught, progress=waiting.process_cpu(proc.pid), poll=0.01, what="the handlers installed")


def _submit(folder: Path, fn) -> None:
    """The pickle sbatch's submitter leaves (submitit waits up to 60 s for it to appear)."""
    tmp = folder / ".submitted.tmp"
    DelayedSubmission(fn).dump(tmp)
    os.replace(tmp, folder / f"{JOB}_submitted.pkl")


def _result(folder: Path, proc: subprocess.Popen, tmp_path: Path):
    assert proc.wait(timeout=HANG_S) == 0, (tmp_path / "err").read_text()
    status, value = pickle.loads((folder / f"{JOB}_0_result.pkl").read_bytes())
    assert status == "success", value
    return value


def test_a_signal_before_the_task_is_even_unpickled_is_recorded_and_handed_to_the_entry(tmp_path):
    from tests.unit._task_main_probe import ProbeTask

    folder = tmp_path / "submitit"
    folder.mkdir()
    proc = _start(folder, ["-m", "lmtrain.task.main", "--signal", "USR2"], tmp_path)
    try:
        _wait_caught(proc, {signal.SIGUSR2, signal.SIGTERM})  # lmtrain's, while submitit waits for the pickle
        os.kill(proc.pid, signal.SIGUSR2)  # SLURM's time-limit warning, this early
        time.sleep(0.2)
        assert proc.poll() is None
        _submit(folder, ProbeTask(str(tmp_path / "run")))
        got = _result(folder, proc, tmp_path)
    finally:
        proc.kill()
    assert got["handlers"] == {"SIGUSR2": "SignalOwner._handle", "SIGTERM": "SignalOwner._handle"}, got
    assert got["before"] == {"requested": True, "reason": "timeout", "count": 1}, got  # kept for the entry
    assert got["count"] == 3  # SIGTERM and SIGUSR2 in the task: recorded, the process lives on


def test_under_submitits_own_runner_that_early_signal_kills_the_task(tmp_path):
    """What task_main is for: the same moment under ``submitit.core._submit`` (the runner before it),
    where the warning signal's default action ends the task (SLURM records the job FAILED)."""
    folder = tmp_path / "submitit"
    folder.mkdir()
    proc = _start(folder, ["-m", "submitit.core._submit"], tmp_path)
    try:
        def loading() -> bool:  # submitit now waits for it
            assert proc.poll() is None, _output(tmp_path)
            return "Loading pickle" in _output(tmp_path)

        waiting.until(loading, progress=waiting.process_cpu(proc.pid), poll=0.02, what="submitit loading the pickle",
                      explain=lambda: _output(tmp_path))
        assert signal.SIGUSR2 not in _caught(proc.pid)
        os.kill(proc.pid, signal.SIGUSR2)
        assert proc.wait(timeout=HANG_S) == -signal.SIGUSR2
    finally:
        proc.kill()


def test_any_other_callable_gets_submitits_handlers(tmp_path):
    from tests.unit._task_main_probe import plain

    folder = tmp_path / "submitit"
    folder.mkdir()
    proc = _start(folder, ["-m", "lmtrain.task.main", "--signal", "USR2"], tmp_path)
    try:
        _submit(folder, plain)
        got = _result(folder, proc, tmp_path)
    finally:
        proc.kill()
    assert got["SIGUSR2"].endswith("checkpoint_and_try_requeue") and got["SIGTERM"].endswith("bypass"), got


@pytest.mark.parametrize("runner, succeeds", [(["-m", "lmtrain.task.main", "--signal", "USR2"], True),
                                               (["-m", "submitit.core._submit"], False)])
def test_a_result_an_earlier_attempt_was_killed_writing_does_not_fail_the_next(tmp_path, runner, succeeds):
    """A requeue kills the steps as rank 0 returns, so an attempt can die inside submitit's write
    of its result and leave ``<job>_<task>_result.pkl.save_tmp``; the same job and task's next
    attempt trained to the end and then failed on submitit's "A temporary saved file already
    exists". task_main removes the stale file first; submitit's own runner still fails."""
    from tests.unit._task_main_probe import plain

    folder = tmp_path / "submitit"
    folder.mkdir()
    stale = folder / f"{JOB}_0_result.pkl.save_tmp"
    stale.write_bytes(b"\x80\x05half a pickle")  # where the killed attempt stopped writing
    _submit(folder, plain)
    proc = _start(folder, runner, tmp_path)
    try:
        if succeeds:
            _result(folder, proc, tmp_path)
            assert not stale.exists()
            assert f"removed {stale}" in _output(tmp_path)
        else:
            assert proc.wait(timeout=HANG_S) != 0
            assert "A temporary saved file already exists" in _output(tmp_path)
            assert not (folder / f"{JOB}_0_result.pkl").exists()
    finally:
        proc.kill()


@pytest.mark.parametrize("fails", [False, True])
def test_a_task_other_than_the_first_runs_the_callable_and_writes_no_result(tmp_path, fails):
    """Only task 0 writes submitit's result (or error) pickle: the others' were a file per rank per
    job that nothing reads. The callable still runs with submitit's handlers (it is not lmtrain's
    task), and a failure still ends the task non-zero with its traceback on stderr."""
    from tests.unit._task_main_probe import fail, touch

    folder = tmp_path / "submitit"
    folder.mkdir()
    mark = tmp_path / "ran"
    _submit(folder, fail if fails else lambda: touch(str(mark)))
    proc = _start(folder, ["-m", "lmtrain.task.main", "--signal", "USR2"], tmp_path, rank=1)
    try:
        rc = proc.wait(timeout=HANG_S)
    finally:
        proc.kill()
    assert sorted(p.name for p in folder.iterdir()) == [f"{JOB}_submitted.pkl"], _output(tmp_path)
    if fails:
        assert rc == 1 and "ValueError: the task failed on purpose" in _output(tmp_path), _output(tmp_path)
    else:
        assert rc == 0, _output(tmp_path)
        assert "checkpoint_and_try_requeue" in mark.read_text()  # submitit's handler: not lmtrain's task
        assert "no result pickle: not the job's first task" in _output(tmp_path)


@pytest.mark.parametrize("argv", [[], ["--signal"], ["--signal", "USR2"], ["a", "b"]])
def test_a_malformed_command_line_says_how_to_call_it(argv):
    out = subprocess.run([sys.executable, "-m", "lmtrain.task.main", *argv], capture_output=True, text=True,
                         timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert out.returncode == 1 and "usage: python -m lmtrain.task.main [--signal NAME] FOLDER" in out.stderr


def test_a_rank_in_a_container_ends_when_the_slurm_task_that_started_it_is_gone():
    """SLURM SIGKILLs a step's podman client, not the container conmon keeps; the rank inside
    watches the client's pid (LMLAUNCH_TASK_PID, set by src/lmcore/job/podman_task.sh) and ends."""
    owner = subprocess.Popen(["sleep", "600"])
    rank = subprocess.Popen(
        [sys.executable, "-c", "from lmtrain.task.main import watch_owner; import time; "
         "watch_owner(poll_s=0.1); time.sleep(600)"],
        env={**os.environ, "LMLAUNCH_TASK_PID": str(owner.pid)}, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert rank.poll() is None  # alive while its owner is
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert rank.wait(timeout=HANG_S) == 137
    assert "is gone: this rank ends with it" in rank.stderr.read()
