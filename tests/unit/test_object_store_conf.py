"""The local object store's ceph.conf (launcher.localcluster.object_store.render_conf), read as Ceph
would: one monitor on msgr2 only, the daemons' ports away from SLURM's, every path absolute (Debian
13's Ceph 18 resolves a relative object-class directory against the working directory, and radosgw
then fails with EOPNOTSUPP), authentication off and every connection in crc mode (no key, no
"secure" mode: radosgw's monitor connection otherwise fails with EACCES)."""

from __future__ import annotations

import configparser
from pathlib import Path

import waiting

from launcher.localcluster import object_store as o
from launcher.localcluster.config import MAX_WORKER_SLOTS, Ports


def test_the_conf_keeps_ports_apart_paths_absolute_and_every_connection_in_crc_mode(tmp_path):
    layout = o.store_layout(tmp_path / "s3")
    conf = configparser.ConfigParser(interpolation=None)
    conf.read_string(o.render_conf(layout, "f" * 36, "/usr/lib/x86_64-linux-gnu/rados-classes"))
    g = conf["global"]
    assert g["mon_host"] == f"v2:127.0.0.1:{o.MON_PORT}" and g["ms_bind_msgr1"] == "false"
    low, high = int(g["ms_bind_port_min"]), int(g["ms_bind_port_max"])
    slurm = {p for slot in range(MAX_WORKER_SLOTS + 1) for v in (None, "24.11", "26.05") for p in
             (lambda ports: (ports.slurmctld, ports.slurmdbd, ports.mariadb, *ports.nodes))(Ports.for_slot(slot, v).with_nodes(8))}
    assert not {p for p in slurm if low <= p <= high or p in (o.MON_PORT, o.RGW_PORT)}, "a port of SLURM's"
    assert {g[k] for k in g if k.startswith("auth_")} == {"none"} and {g[k] for k in g if k.endswith("_mode") and
                                                                    k.startswith("ms_")} == {"crc"}
    assert conf["osd.0"]["osd_class_dir"] == "/usr/lib/x86_64-linux-gnu/rados-classes"
    paths = [v for s in conf.sections() for k, v in conf[s].items() if k.endswith(("_data", "_path", "_dir", "_file"))]
    assert paths and all(Path(p.replace("$name", "x")).is_absolute() for p in paths), paths
    assert conf["osd.0"]["bluestore_block_path"] == str(layout.block)
    assert f"endpoint=127.0.0.1:{o.RGW_PORT}" in conf["client.rgw.a"]["rgw_frontends"]


def test_a_daemon_is_running_only_as_its_program_with_this_stores_conf(tmp_path):
    """By the pid file's process's command line, not its start against the file's age (a VM clock
    step made a running monitor look gone, and a second one was started): a live process of another
    program (a reused pid) or a dead pid is not the daemon."""
    import os
    import subprocess
    import sys

    layout = o.store_layout(tmp_path / "s3")
    layout.pidfile("mon.a").parent.mkdir(parents=True)
    layout.pidfile("mon.a").write_text(f"{os.getpid()}\n")
    assert o.running(layout, "mon.a") is None  # this python: another program
    fake = tmp_path / "ceph-mon"
    fake.symlink_to(sys.executable)
    proc = subprocess.Popen([str(fake), "-c", "import time; time.sleep(60)", "-c", str(layout.conf), "-i", "a"])
    try:
        layout.pidfile("mon.a").write_text(f"{proc.pid}\n")
        # once the child has exec'd (until then its command line is its parent's, this python's)
        assert waiting.until(lambda: o.running(layout, "mon.a"), progress=waiting.process_cpu(proc.pid),
                             what="the fake ceph-mon started", poll=0.02) == proc.pid
        other = o.store_layout(tmp_path / "other")
        other.pidfile("mon.a").parent.mkdir(parents=True)
        other.pidfile("mon.a").write_text(f"{proc.pid}\n")
        assert o.running(other, "mon.a") is None  # the program, but another store's conf
    finally:
        proc.kill()
        proc.wait()
    assert o.running(layout, "mon.a") is None  # gone
