"""lmlaunch renders the sbatch script in submitit's layout itself (launcher.submit.script.sbatch_script,
the one renderer: the header from the same options slurmrestd is sent) and plugs into submitit's
private hooks (``SlurmExecutor._submitit_command_str``, ``_make_submission_file_text`` and
``_make_submission_command`` in launcher.submit.submission). submitit is pinned to the version these
were checked with, and these tests fail loudly when a submitit release changes them: the script is
byte for byte the one submitit's own ``_make_sbatch_string`` writes from the same parameters (its
runner finds its files by that layout), and ``sbatch`` receives the one the dry run prints."""

from __future__ import annotations

import inspect
import os
import re
import stat
from pathlib import Path

from launcher.planning.resolve import resolve
from launcher.submit import script, submission

REPO = Path(__file__).resolve().parents[2]


def test_submitit_is_the_pinned_version():
    import submitit

    text = (REPO / "pyproject.toml").read_text()
    pinned = re.search(r'"submitit==([0-9.]+)"', text)
    assert pinned, "pyproject.toml must pin submitit to one version (its private hooks are used)"
    assert submitit.__version__ == pinned.group(1), (submitit.__version__, pinned.group(1))


def test_the_private_hooks_are_where_lmlaunch_plugs_in():
    from submitit.slurm import slurm as ss

    params = inspect.signature(ss._make_sbatch_string).parameters
    plan = _plan(REPO, "/runs")
    missing = set(script.executor_parameters(plan)) - set(params)
    assert not missing, f"submitit's _make_sbatch_string no longer takes {sorted(missing)}"
    assert isinstance(inspect.getattr_static(ss.SlurmExecutor, "_submitit_command_str"), property)
    assert list(inspect.signature(ss.SlurmExecutor._make_submission_command).parameters) == [
        "self", "submission_file_path"]
    # how submitit uses them: the command string goes into the script, the submission command runs it
    assert "_submitit_command_str" in inspect.getsource(ss.SlurmExecutor._internal_process_submissions)
    assert "_make_submission_command" in inspect.getsource(ss.SlurmExecutor._submit_command)
    assert "_make_sbatch_string" in inspect.getsource(ss.SlurmExecutor._make_submission_file_text)
    # an array's submission copies the executor by SlurmExecutor's module-level name (made ours for the call)
    assert "SlurmExecutor(self.folder" in inspect.getsource(ss.SlurmExecutor._internal_process_submissions)
    # a job's submission writes the text launcher.submit.script rendered (the executor's file-text hook)
    assert list(inspect.signature(ss.SlurmExecutor._make_submission_file_text).parameters) == ["self", "command", "uid"]
    from submitit.core import core

    assert "_make_submission_file_text" in inspect.getsource(core.PicklingExecutor._submit_command)
    # lmtrain.task.main runs submitit's runner with lmtrain's handlers installed first: process_job
    # must install submitit's through JobEnvironment._handle_signals(paths, delayed), after loading
    # the pickle and before calling the task
    from submitit.core import job_environment, submission

    body = inspect.getsource(submission.process_job)
    assert body.index("DelayedSubmission.load") < body.index("env._handle_signals(paths, delayed)") < body.index(
        "delayed.result()")
    assert list(inspect.signature(job_environment.JobEnvironment._handle_signals).parameters) == [
        "self", "paths", "submission"]


def _plan(repo: Path, runs_root: str):
    environ = {"LMLAUNCH_RUNS_ROOT": runs_root, "HOME": "/home/u", "USER": "u"}
    return resolve(str(repo / "jobs" / "tiny-cpu.yaml"), ["trainer.strategy=deepspeed", "trainer.zero_stage=2"], cluster="local",
                   environ=environ).plan


def _fake(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_what_sbatch_receives_is_the_dry_run_script(tmp_path, monkeypatch):
    plan = _plan(REPO, str(tmp_path / "runs"))
    Path(plan.paths.submitit_dir).mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    got, calls = tmp_path / "submitted.sh", tmp_path / "calls"
    _fake(bin_dir, "sbatch", f'cp "$1" {got}\necho "Submitted batch job 4242"\n')
    _fake(bin_dir, "srun", "exit 0\n")
    _fake(bin_dir, "timeout", f'echo "timeout $*" >> {calls}\nshift 2\nexec "$@"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    job_id = submission._submit_with_submitit(plan, fn=print)
    assert job_id == "4242"
    assert got.read_text() == script.render_script(plan)  # byte for byte: our command string is in it
    assert script.submit_command(plan) in got.read_text()
    # our submission command ran sbatch, under its client-side time limit
    assert calls.read_text().startswith(f"timeout --kill-after=5 {submission.sbatch_timeout_s()} sbatch "), calls.read_text()


def test_the_script_is_the_one_submitits_renderer_writes_from_the_same_parameters(tmp_path):
    """A run's job, a sweep's array (``map_count``), a plan with spare nodes, GPUs, a container and
    an evaluator alongside, and submitit's defaults: byte for byte as ``_make_sbatch_string``."""
    from submitit.slurm.slurm import _make_sbatch_string

    environ = {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "HOME": "/home/u", "USER": "u"}
    cases = [("tiny-cpu.yaml", ["resources.spare_nodes=1", "slurm.sbatch={comment: 'a&b'}"]),
             ("tiny-cpu-podman.yaml", []), ("gpt2-124m.yaml", []), ("tiny-cpu-eval.yaml", [])]
    for spec, overrides in cases:
        plan = resolve(str(REPO / "jobs" / spec), overrides, cluster="local" if "gpt2" not in spec else "h100-ib",
                       environ=environ).plan
        params = script.executor_parameters(plan, "afterok:7")
        folder = plan.paths.submitit_dir
        for more in ({}, {"map_count": 3, "array_parallelism": 2}):
            ours = script.sbatch_script("python -m x", folder, **params, **more)
            assert ours.text == _make_sbatch_string(command="python -m x", folder=folder, **params, **more), spec
            header = [line for line in ours.text.splitlines() if line.startswith("#SBATCH ")]
            assert header == script.sbatch_lines(list(ours.options)), spec  # the header is the options
    minimal = {"setup": None, "use_srun": False, "stderr_to_stdout": True}
    assert script.sbatch_script("true", "/f", **minimal).text == _make_sbatch_string(command="true", folder="/f", **minimal)


def test_the_task_command_runs_lmtrains_main_unless_the_runs_code_predates_it(tmp_path):
    plan = _plan(REPO, str(tmp_path / "runs"))
    folder = plan.paths.submitit_dir
    assert script.task_command(plan).endswith(f"-u -m lmtrain.task.main --signal USR2 {folder}")
    code = Path(plan.paths.run_dir) / "code"
    (code / "lmtrain").mkdir(parents=True)  # a snapshot taken before lmtrain.task.main existed
    assert script.task_command(plan).endswith(f"-u -m submitit.core._submit {folder}")
    (code / "lmtrain" / "task").mkdir()
    (code / "lmtrain" / "task" / "main.py").write_text("")
    assert script.task_command(plan).endswith(f"-u -m lmtrain.task.main --signal USR2 {folder}")
    # the plan's own warning signal, whichever it is
    environ = {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs1"), "HOME": "/home/u", "USER": "u"}
    usr1 = resolve(str(REPO / "jobs" / "tiny-cpu.yaml"), ["preemption.signal=USR1"], cluster="local", environ=environ).plan
    assert script.task_command(usr1).endswith(f"-u -m lmtrain.task.main --signal USR1 {usr1.paths.submitit_dir}")
