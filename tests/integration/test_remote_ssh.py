"""From a workstation over SSH (launcher.remote.forward): a real sshd on a loopback port and a cluster
account of its own (tests/integration/sshd_helpers.py); the workstation is this test process with
its own runs root, which must stay empty. Every command goes through the master connection the
user opened with the exact command lmlaunch printed.

One run is submitted from a spec that exists only on the workstation, with the workstation's
code; it is watched, preempted and resumed, and its logs (followed), history, report, export and
a diff are read over ssh; doctor, a sweep and a pipeline (with its stage spec) are dry-run. A
second run is cancelled; a third is submitted by a client killed as soon as the login node's
side started: the submission completes there and leaves no staging behind. Last, the master
connection is closed under `status --watch`, which ends with a message."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import sshd_helpers
import waiting
from preempt_helpers import BASE, finish, held_at, ledger, wait_held
from slurm_helpers import REPO, TERMINAL, pace, wait_for
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.runs import snapshot
from lmcore.slurm import client as slurm


@pytest.fixture(scope="module")
def login_node(tmp_path_factory, slurm_cluster):
    where = tmp_path_factory.mktemp("login-node")
    sockets = Path(tempfile.mkdtemp(prefix="lmcm-", dir="/tmp"))  # a Unix socket's path: at most 107 bytes
    node = sshd_helpers.start(where)
    yield node, sockets
    subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={sockets}/cm-%C", "-F", str(node.config), "cluster-login"],
                   capture_output=True, timeout=HANG_S)
    node.stop()
    shutil.rmtree(sockets, ignore_errors=True)


def test_a_workstation_submits_watches_preempts_exports_and_cancels_over_ssh(login_node, cli, lm_env, run_name,
                                                                            tmp_path):
    node, where = login_node
    there = sshd_helpers.ACCOUNT_HOME / "tests" / run_name  # the cluster account's runs and registry
    shutil.rmtree(there, ignore_errors=True)
    faults = tmp_path / "faults.json"  # a file: ssh's SetEnv splits and unquotes a JSON value
    faults.write_text(json.dumps([pace(), held_at(13)]))  # the first run held at step 13 until its preemption
    passed = {**{k: os.environ[k] for k in ("SLURM_CONF", "LMLAUNCH_CLUSTER_DIR") if k in os.environ},
              "LMLAUNCH_RUNS_ROOT": str(there / "runs"), "LMLAUNCH_HOME": str(there / "home"),
              "LMLAUNCH_FAULTS": str(faults)}  # steps paced, as the preemption tests' are
    profiles = Path(lm_env["LMLAUNCH_HOME"]) / "profiles"
    profiles.mkdir(parents=True)
    control = where / "cm-%C"
    for name, required in (("viassh", False), ("viassh-mfa", True)):
        (profiles / f"{name}.yaml").write_text(
            sshd_helpers.profile_text(REPO, node, control, passed, require_master=required))

    # no master yet: the exact command to open one, at once
    r = cli("--remote", "viassh-mfa", "status")
    assert r.code == 2 and "no ssh master connection to cluster-login is open" in r.err, r.err
    opener = re.search(r"^  (ssh -fNM .*)$", r.err, re.M).group(1)  # type: ignore[union-attr]
    subprocess.run(shlex.split(opener), check=True, timeout=HANG_S, stdin=subprocess.DEVNULL)

    spec = tmp_path / "workstation" / "my-job.yaml"  # only on the workstation
    spec.parent.mkdir()
    shutil.copy(REPO / "jobs" / "tiny-cpu.yaml", spec)
    name = f"{run_name}-a"
    r = cli("--remote", "viassh-mfa", "submit", spec, f"name={name}", *BASE, "trainer.max_steps=40")
    assert r.code == 0, r.out + r.err
    assert re.search(r"sent 1 file\(s\) and this machine's code to cluster-login:\S+: \d+ files, [\d.]+ MB", r.err), r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)  # type: ignore[union-attr]
    run_dir = there / "runs" / name
    assert snapshot.read(run_dir).digest == snapshot.current(snapshot.PACKAGES)[0].digest  # type: ignore[union-attr]
    assert not Path(lm_env["LMLAUNCH_RUNS_ROOT"]).exists()  # nothing on the workstation's side

    wait_held(run_dir, 13, job_id=job_id)
    r = cli("--remote", "viassh", "status", name, "--json")
    assert r.code == 0 and json.loads(r.out)["runs"][0]["name"] == name, r.out + r.err
    r = cli("--remote", "viassh", "stacks", name, "--json")  # py-spy on the nodes, through the login node
    assert r.code == 0 and sorted(t["rank"] for t in json.loads(r.out)) == [0, 1], r.out[-2000:] + r.err
    r = cli("--remote", "viassh", "preempt", name, "--start-now")
    assert r.code == 0, r.out + r.err
    finish(job_id, run_dir)
    assert [e["attempt"] for e in ledger(run_dir) if e.get("event") == "start"] == [1, 2]
    r = cli("--remote", "viassh", "logs", name)
    assert r.code == 0 and "attempt 2 ends: completed" in r.out, r.out[-2000:] + r.err
    r = cli("--remote", "viassh", "history", name, "--json")
    assert r.code == 0 and len(json.loads(r.out)["attempts"]) == 2, r.out + r.err
    r = cli("--remote", "viassh", "export", name, "--to", "hf", there / "export")
    assert r.code == 0 and (there / "export" / "config.json").is_file(), r.out + r.err

    # another run, cancelled from here
    r = cli("--remote", "viassh", "submit", spec, f"name={run_name}-b", *BASE)
    assert r.code == 0, r.out + r.err
    second = re.search(r"job (\d+)", r.out).group(1)  # type: ignore[union-attr]
    r = cli("--remote", "viassh", "cancel", f"{run_name}-b")
    assert r.code == 0, r.out + r.err
    assert wait_for(second, TERMINAL, poll=0.5).startswith("CANCELLED"), slurm.job_state(second)

    # the other commands over the same master, as on the login node
    r = cli("--remote", "viassh", "logs", name, "-f")  # the run has ended: follows nothing more
    assert r.code == 0 and "attempt 2 ends: completed" in r.out, r.err
    r = cli("--remote", "viassh", "status", "--watch", "--count", "2", "--interval", "0.2")
    assert r.code == 0 and name in r.out, r.out + r.err
    r = cli("--remote", "viassh", "report", name, "-o", there / "report.png")
    assert r.code == 0 and (there / "report.png").stat().st_size > 0, r.out + r.err
    r = cli("--remote", "viassh", "diff", name, f"{run_name}-b")
    assert r.code in (0, 1) and f"{name} vs {run_name}-b: " in r.out, r.out + r.err
    r = cli("--remote", "viassh", "doctor", spec, "--json")
    assert r.code in (0, 1) and json.loads(r.out)["checks"], r.out + r.err
    r = cli("--remote", "viassh", "sweep", spec, REPO / "jobs" / "sweeps" / "tiny-lr.yaml", "--dry-run")
    assert r.code == 0 and "nothing submitted" in r.out, r.out + r.err
    r = cli("--remote", "viassh", "pipeline", REPO / "jobs" / "pipelines" / "tiny-train-eval.yaml", "--dry-run")
    assert r.code == 0 and "sent 2 file(s) and this machine's code" in r.err, r.out + r.err  # its stage spec with it

    # the client killed once the login node's side started: the submission completes there
    client = subprocess.Popen([str(Path(sys.executable).parent / "lmlaunch"), "--remote", "viassh", "submit", str(spec),
                               f"name={run_name}-c", *BASE, "trainer.max_steps=5"],
                              env=lm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert client.stderr is not None
    said = client.stderr.readline().decode()
    stage = re.search(r"to cluster-login:~/(\S+):", said)
    assert stage, said + client.stderr.read().decode()
    started = sshd_helpers.ACCOUNT_HOME / stage.group(1) / ".out"  # the login node's side began
    waiting.until(started.exists, progress=waiting.process_cpu(client.pid), poll=0.01, what="the login node's side began")
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    said_status: list[str] = []

    def third_job() -> str | None:
        r = cli("--remote", "viassh", "status", f"{run_name}-c", "--json")
        said_status[:] = [r.out + r.err]
        rows = json.loads(r.out)["runs"] if r.code == 0 else []
        return rows[0]["job_id"] if rows and rows[0]["job_id"] else None

    staging = sshd_helpers.ACCOUNT_HOME / stage.group(1)
    waiting.until(third_job, progress=waiting.watching(waiting.tree(staging, lm_env["LMLAUNCH_RUNS_ROOT"]), lambda: said_status[0]),
                  what=f"{run_name}-c submitted on the login node", explain=lambda: said_status[0])
    waiting.until(lambda: not staging.exists(), progress=waiting.tree(staging), poll=0.2,
                  what="the staging folder removed")  # nothing left in staging
    cli("--remote", "viassh", "cancel", f"{run_name}-c")

    # the master connection dropped under `status --watch`: it ends with a message, not a hang
    watch = subprocess.Popen([str(Path(sys.executable).parent / "lmlaunch"), "--remote", "viassh", "status", "--watch",
                              "--interval", "0.2"], env=lm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    waiting.until(lambda: sshd_helpers.forwarded("status", "--watch"), progress=waiting.process_cpu(watch.pid), poll=0.1,
                  what="`status --watch` running on the login node")
    subprocess.run(["ssh", "-F", str(node.config), "-O", "exit", "-o", f"ControlPath={control}", "cluster-login"],
                   capture_output=True, timeout=HANG_S)
    _, err = watch.communicate(timeout=HANG_S)
    assert watch.returncode == 255, err
    assert b"the ssh connection to cluster-login failed or dropped (ssh exit 255); run the command again" in err, err
    # and nothing of it stays behind on the login node
    waiting.until(lambda: not sshd_helpers.forwarded("status", "--watch"), poll=0.1,
                  progress=lambda: tuple(waiting.process_cpu(p)() for p in sshd_helpers.forwarded("status", "--watch")),
                  what="`status --watch` gone from the login node")
