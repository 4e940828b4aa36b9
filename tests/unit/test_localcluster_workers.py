"""Worker clusters (launcher/localcluster/workers.py): each parallel test worker claims a slot of
its own, with ports and a state directory no other slot uses; a slot is free again once its
holder releases it or dies. (That the clusters are isolated is shown on the real ones:
tests/integration/test_cluster_local.py.)"""

from __future__ import annotations

import os
import time

import pytest

from launcher.localcluster import cluster, config, workers
from launcher.localcluster.config import MAX_WORKER_SLOTS, Layout, Ports
from launcher.localcluster.daemons import ClusterError, wait_until


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "primary_root", lambda version=None: tmp_path / "primary")
    monkeypatch.setattr(workers, "primary_root", lambda version=None: tmp_path / "primary")
    return tmp_path / "primary"


@pytest.mark.parametrize("native", ["22.05", "24.11"])
def test_every_slot_of_every_slurm_version_has_ports_and_a_directory_of_its_own(monkeypatch, native):
    from lmtrain.distributed.task_env import PORT_FLOOR

    monkeypatch.setattr(config, "native_version", lambda: native)
    versions = list(config.SLURM_RELEASES)
    ports = [Ports.for_slot(k, v) for v in versions for k in range(MAX_WORKER_SLOTS + 1)]
    assert Ports.for_slot(0, native) == Ports()
    every = [p for s in ports for p in (s.slurmctld, s.slurmdbd, s.mariadb, *s.with_nodes(8).nodes)]
    assert len(every) == len(set(every)), "two slots share a port"
    assert max(every) < PORT_FLOOR, "a cluster's port among the ones rendezvous draw from"
    roots = {Layout.worker(k, v).root for v in versions for k in range(1, MAX_WORKER_SLOTS + 1)}
    roots |= {config.primary_root(v) for v in versions}
    assert len(roots) == len(versions) * (MAX_WORKER_SLOTS + 1)
    assert config.primary_root("26.05") == config.base_root() / "slurm-26.05"
    assert config.primary_root(None) == config.primary_root(native) == config.base_root()
    assert config.other_version() == ("24.11" if native == "22.05" else "22.05")  # the suite's second phase


def test_settings_keep_the_ports_and_read_files_written_before_ports_were_kept():
    s = cluster.Settings(preempt_send_user_signal=True, ports=Ports.for_slot(3), system_conf=False,
                         accounting=False, min_job_age=2)
    assert cluster.Settings.from_json(s.to_json()) == s
    old = cluster.Settings.from_json('{"preempt_send_user_signal": true}')
    assert old == cluster.Settings(preempt_send_user_signal=True, ports=Ports(), system_conf=True,
                                   accounting=True, min_job_age=300)


def test_more_nodes_take_the_ports_after_the_first_nodes_and_the_settings_keep_them(tmp_path):
    """`cluster up --nodes N`: nodes n1..nN, their slurmd ports one after another (inside the slot's
    stride: no other slot's port), both partitions over all of them; a later `up` keeps the count."""
    three = Ports.for_slot(2).with_nodes(3)
    assert three.nodes == (6821 + 200, 6822 + 200, 6823 + 200) and three.node_names == ("n1", "n2", "n3")
    assert Ports.for_slot(0).with_nodes(config.MAX_NODES).nodes[-1] < Ports.for_slot(1).slurmctld
    with pytest.raises(ValueError, match="1 to 64 virtual nodes"):
        Ports().with_nodes(0)
    s = cluster.Settings(ports=three)
    assert cluster.Settings.from_json(s.to_json()).ports.node_names == ("n1", "n2", "n3")
    conf = config.render_slurm_conf(Layout(tmp_path), user="u", preempt_send_user_signal=False, ports=three)
    assert [line.split()[0] for line in conf.splitlines() if line.startswith("NodeName=")] == [
        "NodeName=n1", "NodeName=n2", "NodeName=n3"]
    assert "Port=6823 " not in conf and "Port=7023 " in conf
    assert sum("Nodes=n1,n2,n3 " in line for line in conf.splitlines() if line.startswith("PartitionName=")) == 2


def test_claims_take_distinct_slots_and_a_released_one_is_free_again(machine):
    a, b = workers.claim(), workers.claim()
    assert (a.slot, b.slot) == (1, 2)
    assert a.layout.root == machine / "workers" / "w1" and a.ports == Ports.for_slot(1)
    assert a.environ() == {"LMLAUNCH_CLUSTER_DIR": str(a.layout.root), "SLURM_CONF": str(a.layout.slurm_conf),
                           "PATH": os.environ["PATH"]}
    a.release()
    c = workers.claim()
    assert c.slot == 1
    b.release()
    c.release()


def test_a_slot_held_by_a_session_is_left_to_it(machine):
    """`cluster up --workers N` takes each slot's claim while it starts that cluster; a slot another
    session holds is skipped (seen: a fresh clone's `cluster up --workers 4` turned the chaos bench's
    3-node worker cluster back into 2 nodes under its running job)."""
    held = workers.claim_slot(1)
    assert held is not None and held.slot == 1
    assert workers.claim_slot(1) is None  # an flock per open file: held, even from this process
    other = workers.claim_slot(2)
    assert other is not None and other.slot == 2
    held.release()
    again = workers.claim_slot(1)
    assert again is not None
    again.release()
    other.release()


def test_a_slot_whose_holder_died_is_free(machine):
    pid = os.fork()
    if pid == 0:  # the child claims slot 1 and dies holding it
        workers.claim()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    held = workers.claim()
    assert held.slot == 1
    held.release()


def test_all_slots_claimed_is_a_clear_error(machine):
    claims = [workers.claim() for _ in range(MAX_WORKER_SLOTS)]
    with pytest.raises(workers.UserError, match=f"all {MAX_WORKER_SLOTS} worker clusters are claimed"):
        workers.claim()
    for c in claims:
        c.release()


def test_a_pid_file_whose_pid_now_belongs_to_a_newer_process_is_stale(tmp_path):
    """Seen after a restart of the worker clusters: slurmd-n2.pid of a dead slurmd held a pid that
    a process of the new start-up had taken, so `up` believed that slurmd ran and never started it
    (the nodes stayed down). A pid file names its daemon only if the process is older than the
    file; and `stop` never signals a process a stale pid file names."""
    import subprocess

    from launcher.localcluster import daemons

    proc = subprocess.Popen(["sleep", "60"])
    try:
        pidfile = tmp_path / "slurmd-n2.pid"
        pidfile.write_text(f"{proc.pid}\n")
        assert daemons.running_from_pidfile(pidfile) == proc.pid  # written after the process started
        old = time.time() - 3600
        os.utime(pidfile, (old, old))  # written an hour before this process existed
        assert daemons.running_from_pidfile(pidfile) is None
        daemons.stop(pidfile, "slurmd n2")
        assert proc.poll() is None and not pidfile.exists()  # not signalled; the stale file removed
    finally:
        proc.kill()
        proc.wait()


def test_a_clusters_environment_drops_another_local_clusters_commands(monkeypatch):
    """A 24.11 cluster's wrappers left on PATH would send 24.11 clients to a 22.05 controller."""
    other = Layout.worker(2, "24.11").bin
    monkeypatch.setenv("PATH", f"{other}:/usr/bin:/bin")
    monkeypatch.setattr(config, "native_version", lambda: "22.05")
    native = cluster.environ_of(Layout.worker(1))
    assert native["PATH"] == "/usr/bin:/bin"
    rooted = cluster.environ_of(Layout.worker(3, "24.11"), "24.11")
    assert rooted["PATH"] == f"{Layout.worker(3, '24.11').bin}:/usr/bin:/bin"


def test_a_daemon_still_logging_its_start_is_waited_for_and_a_silent_one_is_not(tmp_path):
    """The local cluster's start-up waits are bounded by the daemon's progress (its log growing),
    not by a figure tuned on one machine's speed."""
    log = tmp_path / "daemon.log"
    log.write_text("")
    calls = []

    def up() -> bool:  # a slow daemon: a log line at every look, up at the 40th (4 s: twice the timeout)
        calls.append(1)
        with log.open("a") as f:
            f.write("starting\n")
        return len(calls) >= 40

    wait_until(up, 2.0, "slow daemon", log, poll=0.1)
    with pytest.raises(ClusterError, match=r"silent daemon did not come up: .* its log quiet"):
        wait_until(lambda: False, 1.0, "silent daemon", log, poll=0.05)


def test_a_daemon_is_still_its_pid_files_after_the_clock_stepped_forward(tmp_path):
    """Seen on a VM: the wall clock stepped 42 s forward while a worker cluster ran, so every process
    seemed to have started after its pid file was written, and the next `up` refused MariaDB's port as
    "taken by a process the local cluster did not start". A process older by the clock than its file
    is still the daemon when its command line names the file's daemon (and node) of that cluster's
    state directory; any other is stale."""
    import subprocess
    import sys

    from launcher.localcluster import daemons

    state = tmp_path / "w1"
    (state / "run").mkdir(parents=True)
    argv = ["slurmd", "-c", "import time; time.sleep(60)", "-N", "n2", "-f", f"{state}/etc/slurm.conf"]
    proc = subprocess.Popen(argv, executable=sys.executable)
    try:
        old = time.time() - 3600
        for name, ours in (("slurmd-n2.pid", True), ("slurmd-n1.pid", False), ("slurmctld.pid", False)):
            pidfile = state / "run" / name
            pidfile.write_text(f"{proc.pid}\n")
            os.utime(pidfile, (old, old))
            assert daemons.running_from_pidfile(pidfile) == (proc.pid if ours else None), name
        other = tmp_path / "w2" / "run" / "slurmd-n2.pid"  # the same node of another cluster
        other.parent.mkdir(parents=True)
        other.write_text(f"{proc.pid}\n")
        os.utime(other, (old, old))
        assert daemons.running_from_pidfile(other) is None
    finally:
        proc.kill()
        proc.wait()
