"""The local cluster's object store: Ceph's RADOS Gateway as a one-node Ceph cluster on 127.0.0.1 (a
monitor, one OSD on a sparse file, one radosgw), the real S3 server that checkpoints on object
storage are tried against here (shared/DESIGN.md has what was verified of it: Debian 12's Ceph
16.2, its semantics under crashes and concurrent writers).

``lmlaunch cluster up --s3`` calls :func:`up`: the packages installed when missing (as the setup
script installs SLURM's), the cluster bootstrapped once (``STATE/s3``), each daemon started when it
is not running, a user and a bucket made, and the endpoint and keys written to
``STATE/s3/credentials.json`` (mode 600: never on a command line, never printed). ``cluster down``
stops it (:func:`down`); its data stays for the next ``up``. Authentication inside the Ceph cluster
is off (``auth_* = none``, messenger mode ``crc``): everything listens on 127.0.0.1 only; S3 clients
still sign every request with the user's keys.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.localcluster.config import base_root
from launcher.localcluster.daemons import ClusterError, flocked, read_pid, stop, wait_until
from lmcore.objects.credentials import Credentials, s3_client

Say = Callable[[str], None]

PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")  # no ceph-mgr: S3 works without it (300 MiB less)
MON_PORT = 3300  # msgr2 only
RGW_PORT = 7480
OSD_PORTS = (20000, 20099)  # away from 6800-7300, where Ceph's default range meets SLURM's daemons
BLOCK_BYTES = 20 * 2**30  # the OSD's sparse file: room, not disk used
USER = "lmlaunch"
BUCKET = "lmlaunch"
REGION = "default"
DAEMONS = ("mon.a", "osd.0", "client.rgw.a")  # started in this order, stopped in the reverse
PROGRAMS = {"mon.a": "ceph-mon", "osd.0": "ceph-osd", "client.rgw.a": "radosgw"}
START_S = 120.0  # the longest a daemon may take to answer (the first radosgw start creates its pools)


@dataclass(frozen=True)
class StoreLayout:
    """Where the object store keeps everything (``STATE/s3``)."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "ceph.conf"

    @property
    def block(self) -> Path:
        return self.root / "osd-block"  # not inside the OSD's directory: bluestore links "block" to it there

    @property
    def credentials(self) -> Path:
        return self.root / "credentials.json"

    def data(self, name: str) -> Path:
        """A daemon's data directory: ``mon``, ``osd``, ``rgw``."""
        return self.root / {"mon.a": "mon", "osd.0": "osd", "client.rgw.a": "rgw"}[name]

    def pidfile(self, name: str) -> Path:
        return self.root / "run" / f"{name}.pid"

    def log(self, name: str) -> Path:
        return self.root / "log" / f"{name}.log"


def store_layout(root: Path | None = None) -> StoreLayout:
    return StoreLayout(root if root is not None else base_root() / "s3")


def endpoint() -> str:
    return f"http://127.0.0.1:{RGW_PORT}"


CLASS_DIRS = ("/usr/lib/rados-classes", "/usr/lib/x86_64-linux-gnu/rados-classes", "/usr/lib/aarch64-linux-gnu/rados-classes",
              "/usr/lib64/rados-classes")


def class_dir() -> str:
    """Where the OSD's object classes are (radosgw calls them): Debian 13's Ceph 18 defaults to a path
    relative to the working directory ("lib/x86_64-linux-gnu/rados-classes"), and radosgw then fails
    with EOPNOTSUPP; the first of :data:`CLASS_DIRS` that exists, given explicitly."""
    return next((d for d in CLASS_DIRS if Path(d, "libcls_version.so").exists()), CLASS_DIRS[0])


def render_conf(layout: StoreLayout, fsid: str, classes: str = CLASS_DIRS[0]) -> str:
    """Pure: ceph.conf of the one-node cluster (shared/DESIGN.md: the settings it needs)."""
    r = layout.root
    return "\n".join([
        "[global]", f"fsid = {fsid}", f"mon_host = v2:127.0.0.1:{MON_PORT}", "mon_initial_members = a",
        "auth_cluster_required = none", "auth_service_required = none", "auth_client_required = none",
        # without a key no connection can be "secure": every side speaks crc
        *(f"{opt} = crc" for opt in ("ms_cluster_mode", "ms_service_mode", "ms_client_mode", "ms_mon_cluster_mode",
                                      "ms_mon_service_mode", "ms_mon_client_mode")),
        "ms_bind_msgr1 = false", "ms_bind_ipv6 = false", "public_addr = 127.0.0.1",
        f"ms_bind_port_min = {OSD_PORTS[0]}", f"ms_bind_port_max = {OSD_PORTS[1]}",
        "osd_pool_default_size = 1", "osd_pool_default_min_size = 1", "mon_allow_pool_size_one = true",
        "mon_warn_on_pool_no_redundancy = false", "osd_crush_chooseleaf_type = 0",
        "osd_pool_default_pg_num = 8", "osd_pool_default_pgp_num = 8", "osd_pool_default_pg_autoscale_mode = off",
        "mon_max_pg_per_osd = 1000", "mon_data_avail_warn = 1", "mon_data_avail_crit = 0",
        "osd_memory_target = 1073741824",
        f"run_dir = {r}/run", f"log_file = {r}/log/$name.log", f"admin_socket = {r}/run/$name.asok",
        f"pid_file = {r}/run/$name.pid",
        "", "[mon.a]", f"mon_data = {layout.data('mon.a')}",
        "", "[osd.0]", f"osd_data = {layout.data('osd.0')}", "osd_objectstore = bluestore", f"osd_class_dir = {classes}",
        f"bluestore_block_path = {layout.block}", "bluestore_block_create = true",
        f"bluestore_block_size = {BLOCK_BYTES}",
        "", "[client.rgw.a]", f"rgw_frontends = beast endpoint=127.0.0.1:{RGW_PORT} tcp_nodelay=1",
        f"rgw_data = {layout.data('client.rgw.a')}", "rgw_gc_obj_min_wait = 60", "rgw_gc_processor_period = 60",
        "",
    ])


def _run(args: list[str], what: str, timeout: float = 120.0) -> str:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"{what}: {exc}") from None
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1500:]}")
    return proc.stdout


def install(say: Say) -> None:
    """Ceph's packages, when one of its programs is missing (as root; otherwise the command to run)."""
    if all(shutil.which(p) for p in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool")):
        return
    command = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    if os.geteuid() != 0:
        raise ClusterError(f"the object store needs Ceph's packages; as root run: {' '.join(command)}")
    say(f"installing {' '.join(PACKAGES)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, env=env, check=False, timeout=900)

    proc = apt(command)
    if proc.returncode != 0:  # stale package lists: once more after an update
        apt(["apt-get", "update", "-qq"])
        proc = apt(command)
    if proc.returncode != 0 or not shutil.which("radosgw"):
        raise ClusterError(f"apt-get could not install {' '.join(PACKAGES)}: {proc.stderr.strip()[-1500:]}")


def _bootstrap(layout: StoreLayout, say: Say) -> None:
    """A new one-node cluster in ``layout.root``: monitor made, then (with it running) the OSD."""
    say(f"making a one-node Ceph cluster in {layout.root}")
    for d in ("mon.a", "osd.0", "client.rgw.a"):
        layout.data(d).mkdir(parents=True, exist_ok=True)
    (layout.root / "run").mkdir(exist_ok=True)
    (layout.root / "log").mkdir(exist_ok=True)
    fsid = str(uuid.uuid4())
    layout.conf.write_text(render_conf(layout, fsid, class_dir()))
    monmap = layout.root / "monmap"
    _run(["monmaptool", "--create", "--add", "a", f"v2:127.0.0.1:{MON_PORT}", "--fsid", fsid, str(monmap)], "monmaptool")
    _run(["ceph-mon", "-c", str(layout.conf), "--mkfs", "-i", "a", "--monmap", str(monmap)], "ceph-mon --mkfs")
    _start_daemon(layout, "mon.a", say)
    osd_uuid = str(uuid.uuid4())
    _run(["ceph", "-c", str(layout.conf), "osd", "new", osd_uuid], "ceph osd new")
    _run(["ceph-osd", "-c", str(layout.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid], "ceph-osd --mkfs")
    _run(["ceph", "-c", str(layout.conf), "osd", "crush", "add", "osd.0", "1.0", "host=localhost", "root=default"],
         "ceph osd crush add")


def _bootstrapped(layout: StoreLayout) -> bool:
    return layout.conf.exists() and (layout.data("osd.0") / "whoami").exists()


def _answers(name: str, layout: StoreLayout) -> bool:
    if name == "client.rgw.a":
        try:
            with urllib.request.urlopen(endpoint() + "/", timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False
    args = ["ceph", "-c", str(layout.conf), "--connect-timeout", "5"]
    try:
        if name == "mon.a":
            return subprocess.run([*args, "mon", "stat"], capture_output=True, timeout=10, check=False).returncode == 0
        out = subprocess.run([*args, "osd", "dump", "--format", "json"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
        return any(o.get("osd") == 0 and o.get("up") == 1 for o in json.loads(out or "{}").get("osds", []))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return False


def running(layout: StoreLayout, name: str) -> int | None:
    """The pid of daemon ``name`` of this store when it runs: its pid file's process is that program
    with this store's ceph.conf on its command line (not the pid file's age against the process's
    start, which a step of the VM's clock upsets: seen, a running monitor taken for gone and a
    second one started, which failed on the pid file's lock)."""
    pid = read_pid(layout.pidfile(name))
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if pid else []
    except OSError:
        return None
    return pid if argv and Path(argv[0]).name == PROGRAMS[name] and str(layout.conf) in argv else None


def _start_daemon(layout: StoreLayout, name: str, say: Say) -> None:
    """``name`` started unless it runs (it daemonizes and writes its pid file), waited for until it answers."""
    if running(layout, name) is None:
        program, ident = PROGRAMS[name], {"mon.a": ["-i", "a"], "osd.0": ["-i", "0"], "client.rgw.a": ["-n", name]}[name]
        say(f"starting {program} ({name})")
        _run([program, "-c", str(layout.conf), *ident], f"{program} {name}")
    wait_until(lambda: _answers(name, layout), START_S, f"the object store's {name}", layout.log(name), poll=0.5)


def up(say: Say, root: Path | None = None) -> Credentials:
    """The object store running, idempotently; its credentials (also in ``credentials.json``)."""
    layout = store_layout(root)
    layout.root.mkdir(parents=True, exist_ok=True)
    with flocked(layout.root / ".up.lock"):
        install(say)
        if not _bootstrapped(layout):
            _bootstrap(layout, say)
        for name in DAEMONS:
            _start_daemon(layout, name, say)
        creds = _user_and_bucket(layout, say)
    say(f"object store: S3 at {creds.endpoint}, bucket {creds.bucket}; keys in {layout.credentials} (mode 600)")
    return creds


def _user_and_bucket(layout: StoreLayout, say: Say) -> Credentials:
    """The user (made once: radosgw-admin gives its keys), the bucket (made once), the credentials file."""
    admin = ["radosgw-admin", "-c", str(layout.conf), "-n", "client.rgw.a"]
    try:
        info = json.loads(_run([*admin, "user", "info", "--uid", USER], "radosgw-admin user info"))
    except ClusterError:
        say(f"making the object store's user {USER}")
        info = json.loads(_run([*admin, "user", "create", "--uid", USER, "--display-name", USER], "radosgw-admin user create"))
    key = info["keys"][0]
    creds = Credentials(endpoint(), key["access_key"], key["secret_key"])
    client = s3_client(creds)
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=creds.bucket)
    except ClientError:
        say(f"making the bucket {creds.bucket}")
        client.create_bucket(Bucket=creds.bucket)
    from lmcore.atomic import write_atomic

    write_atomic(layout.credentials, creds.to_json(), mode=0o600)
    return creds


def remove_bucket(client: Any, bucket: str) -> None:
    """``bucket`` emptied (its objects and incomplete multipart uploads) and removed: a test's or a bench's own."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    client.delete_bucket(Bucket=bucket)


def down(say: Say, root: Path | None = None) -> None:
    """Every daemon of the object store stopped (its data kept); nothing said when none ran."""
    layout = store_layout(root)
    for name in reversed(DAEMONS):
        said = stop(layout.pidfile(name), f"the object store's {name}", find=functools.partial(running, layout, name))
        if said:
            say(said)


@dataclass(frozen=True)
class StoreStatus:
    made: bool  # bootstrapped once (its data kept across `down`)
    running: dict[str, bool]  # each daemon by name
    answers: bool  # S3 answers at :func:`endpoint`
    credentials: Path | None


def status(root: Path | None = None) -> StoreStatus:
    """Reads only: whether it was made, which daemons run, whether S3 answers."""
    layout = store_layout(root)
    up = {name: running(layout, name) is not None for name in DAEMONS}
    return StoreStatus(_bootstrapped(layout), up, up["client.rgw.a"] and _answers("client.rgw.a", layout),
                       layout.credentials if layout.credentials.exists() else None)
