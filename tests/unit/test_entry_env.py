"""Task environment: SLURM hostlists, SLURM/local variables, and the MASTER_PORT rendezvous."""

from __future__ import annotations

import os
import threading

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmtrain.distributed.task_env import expand_hostlist, read_env, rendezvous


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("gpu-[01-03,07],login1", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "login1"]),
        ("a[1-2]-ib[3-4]", ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]),
    ],
)
def test_slurm_hostlist_expands(text, hosts):
    assert expand_hostlist(text) == hosts


def test_slurm_variables_give_rank_world_job_and_restart():
    env = read_env({
        "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
    })
    assert (env.launcher, env.rank, env.local_rank, env.node_rank, env.world_size) == ("slurm", 3, 1, 1, 4)
    assert env.nodes == ("n1", "n2") and env.rendezvous_key == "812-2"
    # a restart in place (the batch script's srun again): the same job and restart count, a new step
    again = read_env({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "4",
                      "SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "2", "SLURM_STEP_ID": "1"})
    assert again.step_id == 1 and again.rendezvous_key == "812-2-s1" != env.rendezvous_key


def test_array_task_job_id_is_array_id_underscore_task():
    env = read_env({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
                    "SLURM_JOB_ID": "900", "SLURM_ARRAY_JOB_ID": "899", "SLURM_ARRAY_TASK_ID": "1"})
    assert env.job_id == "899_1" and env.restart_count == 0


def test_local_launcher_variables_win_over_slurm_ones():
    env = read_env({"LMTRAIN_LAUNCHER": "local", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                    "LMTRAIN_JOB_ID": "local-1", "SLURM_PROCID": "0"})
    assert (env.launcher, env.rank, env.world_size, env.job_id) == ("local", 1, 2, "local-1")


def test_rank0_publishes_a_port_and_attempt_that_other_ranks_adopt(tmp_path, monkeypatch):
    base = {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "55",
            "SLURM_JOB_NODELIST": "localhost"}
    _no_master_vars_after(monkeypatch)
    r1 = read_env({**base, "SLURM_PROCID": "1"})
    r0 = read_env({**base, "SLURM_PROCID": "0"})
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("r1", rendezvous(r1, tmp_path, attempt=None, timeout_s=20)))
    waiter.start()  # rank 1 starts first and waits for rank 0's file
    published = rendezvous(r0, tmp_path, attempt=3)
    waiter.join()
    assert got["r1"] == published and published.attempt == 3 and 1024 < published.port < 65536
    assert os.environ["MASTER_PORT"] == str(published.port)
    assert (tmp_path / "rendezvous" / "55-0.json").exists()


def _no_master_vars_after(monkeypatch) -> None:
    """rendezvous() sets MASTER_ADDR/PORT in os.environ: gone again after the test (a bare delenv
    of an unset variable restores nothing, and jobs later submitted from this process inherited
    the port)."""
    for name in ("MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.setenv(name, "set-by-the-test")
        monkeypatch.delenv(name)


def test_a_slurm_task_ignores_a_master_port_inherited_from_the_submitting_shell(tmp_path, monkeypatch):
    _no_master_vars_after(monkeypatch)
    monkeypatch.setenv("MASTER_PORT", "80")  # what sbatch --export=ALL carried over
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    r0 = read_env({"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "56",
                   "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": "0"})
    published = rendezvous(r0, tmp_path, attempt=1)
    assert published.port != 80 and published.addr != "10.9.9.9", published
    assert os.environ["MASTER_PORT"] == str(published.port)


def test_a_rendezvous_port_is_drawn_below_the_ephemeral_range_where_connections_do_not_take_it():
    """bind(0) and every outgoing connection draw from the kernel's ephemeral range: a port taken
    from there, released and bound again by the rendezvous store could meanwhile be a gloo
    connection's (EADDRINUSE, seen in a parallel suite run)."""
    import socket

    from lmtrain.distributed.task_env import PORT_FLOOR, _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(PORT_FLOOR <= p < low for p in ports), (sorted(ports), low)
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def test_a_local_rank_keeps_the_launchers_pythonpath_after_the_plans():
    from lmtrain.local.launch import worker_env

    plan_env = {"PYTHONPATH": "/runs/r/code", "OMP_NUM_THREADS": "2"}
    env = worker_env(0, 1, port=29500, job_id="j", plan_env=plan_env, base={"PYTHONPATH": "/opt/site", "SLURM_JOB_ID": "4"})
    assert env["PYTHONPATH"] == "/runs/r/code:/opt/site" and "SLURM_JOB_ID" not in env
    assert worker_env(0, 1, port=29500, job_id="j", plan_env=plan_env, base={})["PYTHONPATH"] == "/runs/r/code"


def _one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    return dist


def test_a_rank_leaves_its_process_groups_before_it_exits(tmp_path):
    from lmtrain.distributed.task_env import leave_process_group

    dist = _one_rank_group(tmp_path)
    dist.new_group([0])  # a subgroup too (device meshes make them)
    assert leave_process_group() and not dist.is_initialized()
    assert leave_process_group()  # nothing left: nothing to do


def test_a_parting_that_hangs_is_given_up_on_and_the_rank_exits(tmp_path, monkeypatch, caplog):
    from lmtrain.distributed import task_env

    dist = _one_rank_group(tmp_path)
    release = threading.Event()
    real = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait())  # a peer that never parts
    try:
        assert task_env.leave_process_group(within_s=0.2) is False
        assert "did not part within" in caplog.text
    finally:
        release.set()
        real()


@pytest.mark.parametrize("where, env, documented", [
    ("the CLI", {}, True),
    ("an srun task", {"SLURM_PROCID": "0", "LMLAUNCH_RUN_DIR": "/runs/x"}, False),
    ("a local launch's rank", {"LMTRAIN_LAUNCHER": "local"}, False),
])
def test_a_tasks_schemas_read_no_documentation_and_the_clis_do(where, env, documented):
    """The spec's field docstrings are its documentation (`lmlaunch schema`, the reference page) and
    cost a task's start its imports' frames walked (lmcore.job.strict_model): read where a user
    reads them, never in a rank, whichever launcher started it."""
    import subprocess
    import sys

    probe = ("from lmcore.job.spec import JobSpec; "
             "print(JobSpec.model_config['use_attribute_docstrings'], bool(JobSpec.model_fields['name'].description))")
    base = {k: v for k, v in os.environ.items() if k not in ("SLURM_PROCID", "LMLAUNCH_RUN_DIR", "LMTRAIN_LAUNCHER")}
    done = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(documented), str(documented)], (where, done.stdout)
