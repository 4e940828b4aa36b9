"""Containers: the job scripts of each runtime (pyxis and Apptainer are not installable on this
machine kind, so their scripts are checked as text and by `bash -n`; podman runs for real in
tests/integration/test_preempt_resume.py), the merge of profile and spec, and the SLURM relay
(the real bash script, the real client, real `scontrol`)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import waiting
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.planning.resolve import resolve
from launcher.submit.script import render_script, stop_lines
from lmcore.job.container import ContainerSpec, merged
from lmcore.slurm import client as slurm, relay as slurm_relay

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "jobs" / "llama-1b-container.yaml")
ENV = {"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/home/u", "USER": "u", "PATH": os.environ["PATH"]}
RELAY_SCRIPT = REPO / "src" / "lmcore" / "slurm" / slurm_relay.SCRIPT


def _script(cluster: str, *overrides: str) -> str:
    r = resolve(JOB, list(overrides), cluster=cluster, environ=ENV)
    script = render_script(r.plan)
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr + script
    return script


def _srun(script: str) -> list[str]:
    line = next(x for x in script.splitlines() if x.startswith("srun "))
    return shlex.split(line)


def test_pyxis_runs_the_task_in_the_image_with_srun_options_and_the_host_keeps_slurm():
    script = _script("h100-ib")
    argv = _srun(script)
    assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in argv  # enroot's registry#image form
    mounts = next(a for a in argv if a.startswith("--container-mounts="))
    assert "/dev/infiniband:/dev/infiniband" in mounts  # the profile's, with its reason in the plan
    assert "/runs:/runs" in mounts and "/shared/datasets/slimpajama-llama" in mounts  # at their own paths
    env = next(a for a in argv if a.startswith("--container-env=")).split("=", 1)[1].split(",")
    assert {"PYTHONPATH", "NCCL_IB_HCA", "LMLAUNCH_RUN_DIR", "MELLANOX_VISIBLE_DEVICES"} <= set(env)
    assert argv[-7:-1] == ["python", "-u", "-m", "lmtrain.task.main", "--signal", "USR2"]  # the image's python
    # the batch script (on the host) starts the relay before srun and stops it after
    lines = script.splitlines()
    start = next(i for i, x in enumerate(lines) if slurm_relay.SCRIPT in x)
    assert start < next(i for i, x in enumerate(lines) if x.startswith("srun "))
    assert lines[-3:] == stop_lines()
    assert lines[-4] == "# teardown" and lines[-3].startswith("lmlaunch_rc=$?")  # srun's status, taken first


def test_apptainer_execs_the_image_with_the_gpus_and_the_planned_variables_winning():
    script = _script("a100-roce")
    argv = _srun(script)
    i = argv.index("apptainer")
    assert argv[i:i + 3] == ["apptainer", "exec", "--nv"]  # GPU nodes: --nv added, with its reason
    binds = argv[argv.index("--bind") + 1].split(",")
    assert "/etc/libibverbs.d:/etc/libibverbs.d:ro" in binds and "/dev/infiniband" in binds
    assert argv[argv.index("--pwd") + 2] == "docker://nvcr.io/nvidia/pytorch:25.01-py3"
    assert 'export APPTAINERENV_PYTHONPATH="$PYTHONPATH"' in script
    assert 'export APPTAINERENV_NCCL_IB_GID_INDEX="$NCCL_IB_GID_INDEX"' in script


def test_podman_on_a_gpu_cluster_gets_the_gpus_and_names_its_container_per_task():
    script = _script("h100-ib", "container.runtime=podman")
    argv = _srun(script)
    assert argv[argv.index("/bin/bash") + 1].endswith("/code/lmcore/job/podman_task.sh")
    for flag in ("--rm", "--network=host", "--ipc=host", "--pid=host", "--device=nvidia.com/gpu=all",
                 "--env=SLURM*", "--env=NCCL_*", "--env=PYTHONPATH", "--volume=/runs:/runs"):
        assert flag in argv, flag
    assert argv[argv.index("nvcr.io/nvidia/pytorch:25.01-py3") + 1] == "python"
    task = (REPO / "src" / "lmcore" / "job" / "podman_task.sh").read_text()
    assert "SLURM_CLUSTER_NAME" in task and "SLURM_PROCID" in task
    assert subprocess.run(["bash", "-n", str(REPO / "src/lmcore/job/podman_task.sh")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(RELAY_SCRIPT)]).returncode == 0


STAND_IN_CLIENT = """#!/bin/bash
# podman's client as it behaved under load: it forwards no signal; 'run' starts the command apart
# from itself (conmon's place) with the --env K=V it was given
[ "$1" = rm ] && exit 0
shift; envs=()
while [ "${1#-}" != "$1" ]; do case "$1" in --env) envs+=("$2"); shift 2;; --name) shift 2;; *) shift;; esac; done
shift; trap "" TERM USR1
env "${envs[@]}" setsid "$@" &
wait $!
"""
RANK = """import os, signal, sys, time
seen = open(sys.argv[1] + ".signals", "a")
def note(n, f):
    seen.write(signal.Signals(n).name + " ")
    seen.flush()
    if n == signal.SIGTERM:
        sys.exit(7)
for s in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, note)
open(sys.argv[1], "w").write(os.environ["LMLAUNCH_TASK_PID"])
time.sleep(600)
"""

def test_the_podman_task_signals_the_container_itself_and_ends_with_its_status(tmp_path):
    """SLURM's signals reach the processes in the container from the task's shell, whatever the
    client forwards, and the task ends with the container's exit status."""
    (tmp_path / "podman").write_text(STAND_IN_CLIENT)
    (tmp_path / "podman").chmod(0o755)
    (tmp_path / "rank.py").write_text(RANK)
    started = tmp_path / "started"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "5", "SLURM_PROCID": "0"}
    env.pop("LMLAUNCH_TASK_PID", None)
    task = subprocess.Popen(["bash", str(REPO / "src/lmcore/job/podman_task.sh"), "image", sys.executable,
                             str(tmp_path / "rank.py"), str(started)], env=env, text=True)
    waiting.until(lambda: started.exists() and started.read_text(), progress=waiting.process_cpu(task.pid), poll=0.02,
                  what="the container's process started")
    assert started.read_text() == str(task.pid)  # it knows its owner: the task's shell
    seen = tmp_path / "started.signals"
    task.send_signal(signal.SIGUSR1)  # the warning signal
    waiting.until(lambda: seen.exists() and seen.read_text(), progress=waiting.process_cpu(task.pid), poll=0.02,
                  what="the warning signal reached the container")
    task.send_signal(signal.SIGTERM)  # then the preemption
    task.communicate(timeout=HANG_S)
    assert (seen.read_text().split(), task.returncode) == (["SIGUSR1", "SIGTERM"], 7)


def test_a_job_without_an_image_and_runtime_none_run_on_the_host():
    plain = _script("h100-ib", "container=null")
    assert "--container-image" not in plain and slurm_relay.SCRIPT not in plain
    off = _script("h100-ib", "container.runtime=none")
    assert "--container-image" not in off and "apptainer" not in off
    # the profile's section alone (no image) puts nothing in a container
    r = resolve(str(REPO / "jobs" / "llama-1b-zero2.yaml"), [], cluster="h100-ib", environ=ENV)
    assert r.plan.container is None


def test_the_spec_section_is_laid_over_the_profiles():
    profile = ContainerSpec.model_validate({"runtime": "pyxis", "mounts": [{"path": "/dev/infiniband", "why": "IB"}],
                                            "env": ["A"]})
    spec = ContainerSpec.model_validate({"image": "img", "mounts": ["/scratch"], "env": ["A", "B"]})
    c = merged(profile, spec)
    assert c is not None and c.runtime == "pyxis" and c.image == "img"
    assert [m.path for m in c.mounts] == ["/dev/infiniband", "/scratch"]
    assert [m.why for m in c.mounts] == ["IB", "listed in the container section"]
    assert c.env == ["A", "B"]
    assert merged(profile, None) is None  # no image: on the host
    assert merged(profile, ContainerSpec.model_validate({"runtime": "none", "image": "x"})) is None


@pytest.fixture
def relay(tmp_path):
    d = tmp_path / "relay"
    proc = subprocess.Popen(["bash", str(RELAY_SCRIPT), str(d)], start_new_session=True)

    def started() -> bool:
        assert proc.poll() is None, "the relay exited before it started"
        return d.is_dir()

    waiting.until(started, progress=waiting.process_cpu(proc.pid), poll=0.02, what="the relay started")
    yield d
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs SLURM's client (the local cluster's packages)")
def test_slurm_commands_of_a_rank_without_them_run_on_the_host_through_the_relay(relay, monkeypatch, tmp_path):
    expected = subprocess.run(["scontrol", "--version"], capture_output=True, text=True).stdout
    # a rank in a container: no SLURM commands on its PATH, the relay directory in its environment
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv(slurm_relay.RELAY_ENV, str(relay))
    assert shutil.which("scontrol") is None
    assert slurm.run(["scontrol", "--version"]).stdout == expected
    # stdin travels too, and a failing command's status and message come back as they were
    proc = slurm_relay.call(str(relay), ["scontrol", "show", "job", "no-such-job"], timeout=HANG_S, input="x")
    assert proc.returncode != 0 and proc.stderr
    # nothing but SLURM's five commands is run, and nothing through a shell
    proc = slurm_relay.call(str(relay), ["touch", str(tmp_path / "canary")], timeout=HANG_S)
    assert proc.returncode == slurm_relay.NOT_RELAYED and "relays only" in proc.stderr
    proc = slurm_relay.call(str(relay), ["scontrol", f"$(touch {tmp_path / 'canary'})"], timeout=HANG_S)
    assert not (tmp_path / "canary").exists()
    assert sorted(p.name for p in relay.iterdir()) == []  # every request cleaned up


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs SLURM's client (the local cluster's packages)")
def test_the_relay_outlives_the_jobs_signals(relay):
    pids = subprocess.run(["pgrep", "-f", f"{RELAY_SCRIPT} {relay}"], capture_output=True, text=True).stdout.split()
    assert pids
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        for pid in pids:
            os.kill(int(pid), sig)
    time.sleep(0.2)
    assert slurm_relay.call(str(relay), ["scontrol", "--version"], timeout=HANG_S).returncode == 0


def test_no_relay_answering_is_said_at_once_or_after_the_timeout(tmp_path):
    with pytest.raises(slurm_relay.RelayError):
        slurm_relay.call(str(tmp_path / "missing"), ["scontrol", "ping"], timeout=1)
    (tmp_path / "idle").mkdir()
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        slurm_relay.call(str(tmp_path / "idle"), ["scontrol", "ping"], timeout=0.3)
    assert time.monotonic() - t < 5 and list((tmp_path / "idle").iterdir()) == []


def _box(runtime: str, image: str):
    from lmcore.job.container import ContainerPlan

    return ContainerPlan(runtime=runtime, image=image, python="python", mounts=[], env=[], workdir="/w", flags=[])


def test_doctor_judges_the_image_and_the_runtime():
    from launcher.doctor.checks import FAIL, OK, WARN
    from launcher.doctor.container import judge_image, judge_runtime

    assert judge_image(_box("apptainer", "/img/x.sif"), local_name_exists=None, file_size=None).status == FAIL
    ok = judge_image(_box("apptainer", "/img/x.sif"), local_name_exists=None, file_size=3 * 10**9)
    assert ok.status == OK and "3.00 GB" in ok.message
    ref = judge_image(_box("pyxis", "docker://nvcr.io/nvidia/pytorch:25.01-py3"), local_name_exists=None, file_size=None)
    assert ref.status == OK and "pulled by the nodes" in ref.message
    missing = judge_image(_box("podman", "localhost/lmlaunch/task:latest"), local_name_exists=False, file_size=None)
    assert missing.status == FAIL and "lmlaunch cluster image" in missing.message
    assert judge_image(_box("podman", "x"), local_name_exists=None, file_size=None).status == WARN
    assert judge_runtime(_box("pyxis", "x"), command_here=False).status == WARN
    assert "--on-nodes" in judge_runtime(_box("apptainer", "x"), command_here=False).message


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is installed by `lmlaunch cluster image`")
def test_doctor_asks_podman_for_the_image_before_trying_the_interpreter_inside(tmp_path):
    from launcher.doctor.checks import FAIL, OK
    from launcher.doctor.container import container_checks

    r = resolve(str(REPO / "jobs" / "tiny-cpu-podman.yaml"), ["container.image=localhost/lmlaunch/no-such:1"],
                environ={**ENV, "LMLAUNCH_RUNS_ROOT": str(tmp_path)})
    checks = {c.name: c for c in container_checks(r.plan)}
    assert checks["container image"].status == FAIL, checks
    assert checks["container runtime"].status == OK
    assert "runtime" not in checks  # not tried in an image that is not there


def test_the_relay_ends_with_the_batch_shell_it_serves(tmp_path):
    """SLURM ends a job's steps when its batch shell ends; the relay, which ignores the job's
    signals, must not outlive it (it would be left polling on the node)."""
    shell = subprocess.Popen(["sleep", "600"])
    relay = subprocess.Popen(["bash", str(RELAY_SCRIPT), str(tmp_path / "relay"), str(shell.pid)])
    time.sleep(0.5)
    assert relay.poll() is None
    shell.kill()
    shell.wait()
    assert relay.wait(timeout=HANG_S) == 0


def test_an_image_file_is_named_by_its_sha256_kept_while_the_file_is_unchanged(tmp_path):
    import hashlib

    from launcher.submit.script import host_lines
    from lmcore.job.container import ContainerPlan

    image = tmp_path / "train.sif"
    image.write_bytes(b"an image" * 1000)
    box = ContainerPlan(runtime="apptainer", image=str(image), python="python", mounts=[], env=[], workdir="/w", flags=[])
    lines = [x for x in host_lines(box, ["PYTHONPATH"]) if slurm_relay.SCRIPT not in x and "relay" not in x]
    script = "\n".join([*lines, 'echo "$LMLAUNCH_IMAGE_ID"'])
    run = lambda: subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], "LMLAUNCH_RUN_DIR": str(tmp_path)},  # noqa: E731
                                 capture_output=True, text=True, check=True).stdout.strip()
    assert run() == "sha256:" + hashlib.sha256(image.read_bytes()).hexdigest()
    kept = tmp_path / "container-image.sha256"
    kept.write_text(kept.read_text().splitlines()[0] + "\nfeed\n")  # the kept sum is used while the file is unchanged
    assert run() == "sha256:feed"
    image.write_bytes(b"another image")
    os.utime(image, (1, 1))
    assert run() == "sha256:" + hashlib.sha256(b"another image").hexdigest()


def test_a_local_run_of_a_container_job_runs_on_this_machine_and_says_so(repo, runs_root):
    """`run --local` starts this machine's processes: its plan (and so the attempts' environment
    records) must not claim the image."""
    from launcher.submit.local_run import prepare_local_run

    said: list[str] = []
    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu-podman.yaml"), [], devices=1, max_steps=20,
                             name="podlocal", environ={**os.environ, "LMLAUNCH_RUNS_ROOT": str(runs_root)},
                             say=said.append)
    assert plan.container is None
    assert any("not in the job's container" in line for line in said), said


def test_a_try_before_submission_leaves_out_what_does_not_exist_yet():
    """`submit` tries the interpreter in the image (launcher.doctor.container.submit_problems): the
    run directory does not exist then, and a runtime would make a mount's source or the working
    directory inside the mounted runs root: the try drops both, keeps the rest."""
    from lmcore.job.container import ContainerPlan, trial_argv

    there = {"/runs", "/data"}
    podman = ContainerPlan(runtime="podman", image="img", python="python3", mounts=[], env=[], workdir="/runs/r",
                           flags=[], prefix=["podman", "run", "--rm", "--volume=/runs:/runs", "--volume=/ckpt/r:/ckpt/r:rw",
                                             "--volume=/data:/data:ro", "--workdir=/runs/r", "img"])
    assert trial_argv(podman, ["-c", "pass"], there.__contains__) == [
        "podman", "run", "--rm", "--volume=/runs:/runs", "--volume=/data:/data:ro", "img", "python3", "-c", "pass"]
    apptainer = ContainerPlan(runtime="apptainer", image="/i.sif", python="python", mounts=[], env=[], workdir="/runs/r",
                              flags=[], prefix=["apptainer", "exec", "--nv", "--bind", "/runs:/runs,/ckpt/r:/ckpt/r",
                                                "--pwd", "/runs/r", "/i.sif"])
    assert trial_argv(apptainer, ["-c", "pass"], there.__contains__) == [
        "apptainer", "exec", "--nv", "--bind", "/runs:/runs", "/i.sif", "python", "-c", "pass"]
    nothing = ContainerPlan(runtime="apptainer", image="/i.sif", python="python", mounts=[], env=[], workdir="/w",
                            flags=[], prefix=["apptainer", "exec", "--bind", "/ckpt:/ckpt", "--pwd", "/w", "/i.sif"])
    assert trial_argv(nothing, [], there.__contains__) == ["apptainer", "exec", "/i.sif", "python"]
