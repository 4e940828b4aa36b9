"""The local object store's ceph.conf (launcher.localcluster.object_store.render_conf), read as Ceph
would: one monitor on msgr2 only, the daemons' ports away from SLURM's, every path absolute (Debian
13's Ceph 18 resolves a relative object-class directory against the working directory, and radosgw
then fails with EOPNOTSUPP), authentication off and every connection in crc mode (no key, no
"secure" mode: radosgw's monitor connection otherwise fails with EACCES)."""

from __future__ import annotations

import configparser
from pathlib import Path

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
