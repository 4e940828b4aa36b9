"""The workstation side of `lmlaunch --remote NAME ...` (launcher.remote.forward, lmcore.slurm.ssh) without
a login node: which profile a command goes to, which files travel and how they are named there,
what the archive holds, and that a missing master connection stops the command at once with the
command that opens it. tests/integration/test_remote_ssh.py runs the whole path through a real sshd."""

from __future__ import annotations

import io
import json
import tarfile
import time

import pytest
import yaml

from launcher.cli import main
from launcher.context import Context
from launcher.remote import forward as remote, read as remote_read
from launcher.runs import snapshot
from lmcore.errors import UserError
from lmcore.slurm.ssh import Connection, remote_path


def test_the_profile_comes_from_the_option_or_the_environment_and_never_twice():
    assert remote_read.split_remote(["--remote", "hpc", "status"], {}) == ("hpc", ["status"])
    assert remote_read.split_remote(["--remote=hpc", "status", "-a"], {}) == ("hpc", ["status", "-a"])
    assert remote_read.split_remote(["status"], {"LMLAUNCH_REMOTE": "hpc"}) == ("hpc", ["status"])
    assert remote_read.split_remote(["--remote", "", "status"], {"LMLAUNCH_REMOTE": "hpc"}) == (None, ["status"])
    # the login node's side never forwards again, whatever its environment says
    assert remote_read.split_remote(["status"], {"LMLAUNCH_REMOTE": "hpc", "LMLAUNCH_FORWARDED": "1"}) == (None, ["status"])
    with pytest.raises(UserError, match="needs a cluster profile name"):
        remote_read.split_remote(["--remote"], {})


def test_the_files_a_command_names_travel_and_overrides_and_options_do_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("name: x\n")
    (tmp_path / "sweep.yaml").write_text("name: s\n")
    (tmp_path / "local").write_text("")  # a file named like the profile: an option's value stays a value
    named, files = remote.shipped_files("sweep", ["sweep", "job.yaml", "./sweep.yaml", "optim.lr=0.1",
                                                  "--cluster", "local", "--max-parallel", "2", "job.yaml"])
    assert named == {"job.yaml": "files/0/job.yaml", "./sweep.yaml": "files/1/sweep.yaml", "local": "files/2/local"}
    assert files["files/1/sweep.yaml"].read_text() == "name: s\n"


def test_a_pipeline_travels_with_its_stage_specs_in_the_same_places_relative_to_it(tmp_path):
    (tmp_path / "jobs" / "pipelines").mkdir(parents=True)
    (tmp_path / "jobs" / "train.yaml").write_text("name: t\n")
    (tmp_path / "jobs" / "pipelines" / "eval.yaml").write_text("name: e\n")
    pipe = tmp_path / "jobs" / "pipelines" / "pipe.yaml"
    pipe.write_text(yaml.safe_dump({"name": "pp", "stages": [{"name": "a", "spec": "../train.yaml"},
                                                             {"name": "b", "spec": "./eval.yaml"}]}))
    named, files = remote.shipped_files("pipeline", ["pipeline", str(pipe), "--dry-run"])
    assert named == {str(pipe): "files/0/pipelines/pipe.yaml"}
    assert files == {"files/0/pipelines/pipe.yaml": pipe, "files/0/train.yaml": tmp_path / "jobs" / "train.yaml",
                     "files/0/pipelines/eval.yaml": tmp_path / "jobs" / "pipelines" / "eval.yaml"}
    pipe.write_text(yaml.safe_dump({"name": "pp", "stages": [{"name": "a", "spec": str(tmp_path / "jobs" / "train.yaml")}]}))
    with pytest.raises(UserError, match="is an absolute path of this machine"):
        remote.shipped_files("pipeline", ["pipeline", str(pipe)])


def test_the_archive_holds_the_files_this_machines_code_and_what_git_says_of_it(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\n")
    data, count, size = remote.archive({"files/0/job.yaml": spec}, with_code=True)
    snap, code = snapshot.current(snapshot.PACKAGES)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = set(tar.getnames())
        git = json.loads(tar.extractfile(f"code/{snapshot.SHIPPED_GIT}").read())  # type: ignore[union-attr]
        assert tar.extractfile("files/0/job.yaml").read() == b"name: x\n"  # type: ignore[union-attr]
    assert names == {"files/0/job.yaml", f"code/{snapshot.SHIPPED_GIT}", *(f"code/{rel}" for rel in code)}
    assert count == len(code) + 1 and size == spec.stat().st_size + snap.size
    assert git == snap.git  # commit, dirty and the patch of uncommitted changes


def test_a_snapshot_on_the_login_node_takes_the_shipped_code_and_its_git_record(tmp_path, monkeypatch):
    data, _, _ = remote.archive({}, with_code=True)
    stage = tmp_path / "stage"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(stage, filter="data")
    monkeypatch.setenv(snapshot.SHIPPED_ENV, str(stage / "code"))
    here = snapshot.current(snapshot.PACKAGES)[0]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    taken = snapshot.take(run_dir)
    assert taken.digest == here.digest and taken.files == here.files
    assert (taken.git or {}).get("commit") == (here.git or {}).get("commit")
    assert snapshot.read(run_dir).digest == here.digest  # type: ignore[union-attr]


def test_output_names_a_shipped_file_as_the_user_named_it():
    shown = remote.as_named_here("~/.lmlaunch/incoming/20261126-1-abc", {"my job.yaml": "files/0/job.yaml"})
    line = "error: /home/u/.lmlaunch/incoming/20261126-1-abc/files/0/job.yaml: trainer.max_steps: bad\n"
    assert shown(line) == "error: my job.yaml: trainer.max_steps: bad\n"
    assert shown("nothing shipped here\n") == "nothing shipped here\n"


def test_a_home_relative_path_is_expanded_by_the_login_shell_and_quoted():
    assert remote_path("~/venvs/lm/bin/lmlaunch") == '"$HOME"/venvs/lm/bin/lmlaunch'
    assert remote_path("/opt/my tools/lmlaunch") == "'/opt/my tools/lmlaunch'"
    assert remote_path("~/a;rm -rf x") == "\"$HOME\"/'a;rm -rf x'"


def _profiles(tmp_path, login: str | None) -> dict[str, str]:
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    text = "partitions: {batch: {max_time: '1:00:00'}}\ndefault_partition: batch\nruns_root: /runs\n"
    (home / "profiles" / "hpc.yaml").write_text(text + (login or ""))
    return {"LMLAUNCH_HOME": str(home)}


def _lm(environ: dict[str, str], *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return main(list(args), Context(stdout=out, stderr=err, environ=environ)), out.getvalue(), err.getvalue()


def test_without_a_master_connection_the_command_stops_at_once_with_the_command_that_opens_it(tmp_path):
    login = ("login: {ssh: nobody@login.example.org, require_master: true, "
             "control_path: /tmp/lmlaunch-test-absent-%C, options: [-p, '2222']}\n")
    environ = _profiles(tmp_path, login)
    start = time.monotonic()
    code, out, err = _lm(environ, "--remote", "hpc", "status")
    took = time.monotonic() - start
    assert code == 2 and out == "" and took < 10.0, (took, err)
    assert "no ssh master connection to nobody@login.example.org is open (the profile requires one" in err
    assert "ssh -fNM -p 2222 -o ControlPath=/tmp/lmlaunch-test-absent-%C -o ControlPersist=yes nobody@login.example.org" in err
    # not a terminal: the same, though the profile does not require a master
    environ = _profiles(tmp_path / "b", login.replace("require_master: true", "require_master: false"))
    code, _, err = _lm(environ, "--remote", "hpc", "status")
    assert code == 2 and "(no terminal to log in at)" in err


def test_a_profile_without_login_and_commands_about_this_machine(tmp_path):
    environ = _profiles(tmp_path, None)
    code, _, err = _lm(environ, "--remote", "hpc", "status")
    assert code == 2 and "cluster profile hpc has no login section" in err
    assert remote.forward("hpc", ["profiles"], Context(io.StringIO(), io.StringIO(), environ)) is None
    code, out, _ = _lm({**environ, "LMLAUNCH_REMOTE": "hpc"}, "profiles")  # runs here
    assert code == 0 and "hpc" in out


def test_ssh_arguments_never_prompt_and_reuse_the_master():
    conn = Connection("login", "/tmp/cm-%C", ("-F", "/cfg"))
    argv = conn.argv("exec lmlaunch status")
    assert argv[:2] == ["ssh", "-F"] and "BatchMode=yes" in argv and "ControlMaster=no" in argv
    assert argv[-2:] == ["login", "exec lmlaunch status"] and "-T" in argv


def test_a_control_path_too_long_for_a_unix_socket_is_named_before_ssh_runs(tmp_path):
    long_dir = "/tmp/" + "d" * 60
    environ = _profiles(tmp_path, f"login: {{ssh: login, control_path: {long_dir}/cm-%C}}\n")
    code, _, err = _lm(environ, "--remote", "hpc", "status")
    assert code == 2 and "login.control_path of cluster profile hpc" in err and "too long for a Unix socket" in err, err
    assert "at most 90" in err


def test_a_forwarded_read_only_command_uses_the_kept_login_while_its_profile_is_unchanged(tmp_path):
    """The lean path (launcher.remote.read): the login section kept after a full load is used
    until the profile file changes or a file of that name appears in a directory read before it."""
    import os

    first, second = tmp_path / "extra", tmp_path / "home" / "profiles"
    second.mkdir(parents=True)
    profile = second / "hpc.yaml"
    profile.write_text("x: 1\n")
    environ = {"LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_PROFILES_DIR": str(first)}
    login = {"ssh": "me@hpc", "lmlaunch": "~/venv/bin/lmlaunch", "require_master": True,
             "control_path": "~/.ssh/cm-%C", "staging": "~/in", "workdir": "~", "options": ["-p", "2222"]}
    remote_read.remember_login(environ, "hpc", login)
    assert remote_read.cached_login(environ, "hpc") == remote_read.LoginFacts(**login)
    assert remote_read.cached_login(environ, "other") is None
    profile.write_text("x: 22\n")  # edited: loaded in full again
    assert remote_read.cached_login(environ, "hpc") is None
    remote_read.remember_login(environ, "hpc", login)
    first.mkdir()
    (first / "hpc.yaml").write_text("y: 1\n")  # a profile of that name now comes first
    assert remote_read.cached_login(environ, "hpc") is None
    os.remove(first / "hpc.yaml")
    assert remote_read.cached_login(environ, "hpc") is not None
