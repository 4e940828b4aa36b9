"""`lmlaunch cluster up | down | status`: a real SLURM cluster on this machine.

Debian's slurm-wlm runs one controller and two `slurmd -N` daemons (virtual nodes n1, n2 on
127.0.0.1, distinct ports); slurmdbd on a MariaDB server (loopback, data under the state
directory) gives real accounting. ``up`` is idempotent and fast when the cluster already runs;
``down`` stops only what ``up`` started, by its pid files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from launcher.localcluster import debian_root, restd
from launcher.localcluster.config import (
    CLUSTER_NAME,
    MAX_NODES,
    MAX_WORKER_SLOTS,
    NODES,
    Layout,
    Ports,
    Settings,
    base_root,
    is_native,
    native_version,
    primary_root,
    render_slurm_conf,
    render_slurmdbd_conf,
)
from launcher.localcluster.daemons import (
    ClusterError,
    alive,
    flocked,
    port_open,
    read_pid,
    run_checked,
    running_from_pidfile,
    spawn,
    stop,
    wait_until,
)
from launcher.localcluster.gpus import make_devices, parse as parse_gpus, remove_devices
from launcher.localcluster.topology import LocalTopology, parse as parse_topology, version_problem
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.search.study_storage import StorageRef
from lmcore.slurm import client as slurm

APT_PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
# the programs each package brings (what `up` needs on PATH)
REQUIRED_PROGRAMS = {
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sinfo": "slurm-wlm",
    "sacctmgr": "slurm-wlm",
    "munged": "munge",
    "slurmdbd": "slurmdbd",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
}
SYSTEM_SLURM_CONF = Path("/etc/slurm/slurm.conf")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET_DIR = Path("/run/munge")
HOSTS_MARKER = "# lmlaunch local cluster nodes"
DB_NAME = "slurm_acct_db"

Say = Callable[[str], None]
T = TypeVar("T")


def environ_of(layout: Layout, version: str | None = None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What a process needs to use ``layout``'s cluster: its SLURM_CONF and state directory, and
    for a cluster in a Debian root (``version`` not the machine's, or wrappers written) its client
    commands first on PATH."""
    env = {"LMLAUNCH_CLUSTER_DIR": str(layout.root), "SLURM_CONF": str(layout.slurm_conf)}
    path = (environ if environ is not None else os.environ).get("PATH", "")
    # another local cluster's client wrappers would send another SLURM version's clients to this one
    # ("Incompatible versions of client and server code")
    base = str(base_root()).rstrip("/") + "/"
    entries = [p for p in path.split(":") if p and not (p.startswith(base) and p.endswith("/bin") and p != str(layout.bin))]
    path = ":".join(entries)
    env["PATH"] = path
    if (not is_native(version) or layout.bin.is_dir()) and str(layout.bin) not in entries:
        env["PATH"] = f"{layout.bin}:{path}" if path else str(layout.bin)
    return env


@contextlib.contextmanager
def own_conf(layout: Layout) -> Iterator[None]:
    """SLURM commands run inside the block talk to ``layout``'s cluster (its SLURM_CONF and, for
    one in a Debian root, its commands), whatever /etc/slurm/slurm.conf or the caller's
    environment names."""
    wanted = environ_of(layout)
    wanted.pop("LMLAUNCH_CLUSTER_DIR")
    old = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).exists()), None
    )


def _sbin_env() -> dict[str, str]:
    env = dict(os.environ)
    if "/usr/sbin" not in env.get("PATH", "").split(":"):
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    return env


# --------------------------------------------------------------------------- packages


def missing_packages() -> list[str]:
    missing = []
    for prog, pkg in REQUIRED_PROGRAMS.items():
        if _which(prog) is None and pkg not in missing:
            missing.append(pkg)
    return missing


def ensure_packages(say: Say) -> None:
    missing = missing_packages()
    if not missing:
        _ensure_rest_packages(say)
        return
    if os.geteuid() != 0:
        raise UserError(
            f"the local SLURM cluster needs the Debian packages {' '.join(missing)}; as root run:\n"
            f"  apt-get install -y {' '.join(APT_PACKAGES)}\n"
            "then `lmlaunch cluster up` again",
            exit_code=1,
        )
    if shutil.which("apt-get") is None:
        raise UserError(
            f"the local SLURM cluster needs {' '.join(missing)} and this machine has no apt-get; "
            "install SLURM (slurmctld, slurmd, slurmdbd), munge and MariaDB with your package manager",
            exit_code=1,
        )
    say(f"installing {' '.join(APT_PACKAGES)} (apt-get)")
    env = {**_sbin_env(), "DEBIAN_FRONTEND": "noninteractive"}
    run_checked(["apt-get", "update", "-qq"], "apt-get update", env=env, timeout=600)
    run_checked(["apt-get", "install", "-y", "-qq", *APT_PACKAGES], "apt-get install", env=env, timeout=1200)
    still = missing_packages()
    if still:
        raise ClusterError(f"after apt-get install, still missing: {' '.join(still)}")
    _ensure_rest_packages(say)


def _ensure_rest_packages(say: Say) -> None:
    """slurmrestd and the JWT plugin where this SLURM's REST API is one lmlaunch speaks (restd.py);
    optional: a cluster without them runs, its REST submission is left out (said once)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None or not restd.wants_rest_packages():
        return
    say(f"installing {' '.join(restd.REST_PACKAGES)} (apt-get): submission through slurmrestd")
    env = {**_sbin_env(), "DEBIAN_FRONTEND": "noninteractive"}
    try:
        run_checked(["apt-get", "install", "-y", "-qq", *restd.REST_PACKAGES], "apt-get install", env=env, timeout=600)
    except ClusterError as exc:
        say(f"slurmrestd not installed ({exc.message}); this cluster runs without its REST API")


# --------------------------------------------------------------------------- munge


def munge_works() -> bool:
    munge, unmunge = _which("munge"), _which("unmunge")
    if not munge or not unmunge:
        return False
    try:
        cred = subprocess.run([munge, "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        out = subprocess.run([unmunge], input=cred.stdout, capture_output=True, timeout=10)
        return out.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_munge(say: Say) -> None:
    if munge_works():
        return
    if os.geteuid() != 0:
        raise UserError(
            "munged is not running and starting it needs root: as root run `lmlaunch cluster up` "
            "(or `runuser -u munge -- munged`)",
            exit_code=1,
        )
    if not MUNGE_KEY.exists():
        say(f"creating munge key {MUNGE_KEY}")
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        run_checked([_which("mungekey") or "mungekey", "--create", f"--keyfile={MUNGE_KEY}"], "mungekey")
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
    for d, mode in ((MUNGE_SOCKET_DIR, 0o755), (Path("/var/log/munge"), 0o700), (Path("/var/lib/munge"), 0o700)):
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
        d.chmod(mode)
    pidfile = MUNGE_SOCKET_DIR / "munged.pid"
    say("starting munged")
    run_checked(
        ["runuser", "-u", "munge", "--", _which("munged") or "munged", f"--pid-file={pidfile}"],
        "munged",
        env=_sbin_env(),
    )
    wait_until(munge_works, 15, "munged", Path("/var/log/munge/munged.log"))
    # record that we started it, so `down` stops it and nothing else; munged is the machine's, so
    # the primary cluster records it whichever cluster's `up` started it
    primary = Layout(primary_root())
    primary.run.mkdir(parents=True, exist_ok=True)
    pid = read_pid(pidfile)
    if pid:
        primary.pidfile("munged").write_text(f"{pid}\n")


# --------------------------------------------------------------------------- MariaDB + slurmdbd


def _db_password(layout: Layout) -> str:
    pw_file = layout.etc / "db-password"
    if pw_file.exists():
        return pw_file.read_text().strip()
    pw = secrets.token_hex(16)
    pw_file.write_text(pw + "\n")
    pw_file.chmod(0o600)
    return pw


def ensure_mariadb(layout: Layout, ports: Ports, password: str, say: Say) -> None:
    if running_from_pidfile(layout.pidfile("mariadb")) and port_open(ports.mariadb):
        return
    if port_open(ports.mariadb):
        raise ClusterError(
            f"port {ports.mariadb} on 127.0.0.1 is taken by a process the local cluster did not start; "
            "stop it, then `lmlaunch cluster up`"
        )
    fresh = not (layout.mysql_data / "mysql").exists()
    tmp = _mariadb_dirs(layout)
    user = ["--user=mysql"] if os.geteuid() == 0 else []
    if fresh:
        say(f"initialising MariaDB data in {layout.mysql_data}")
        _install_mariadb(layout, user, tmp)
    say(f"starting MariaDB on 127.0.0.1:{ports.mariadb}")
    _start_mariadb(layout, ports, user, tmp)
    sql = (
        f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
        f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"GRANT ALL ON {DB_NAME}.* TO 'slurm'@'127.0.0.1';"
        "FLUSH PRIVILEGES;"
    )
    run_checked(
        [_which("mariadb") or "mariadb", "--no-defaults", f"--socket={layout.mysql_socket}", "-u", "root", "-e", sql],
        "creating the accounting database",
    )


SWEEPS_DB = "lmlaunch_sweeps"  # the searches' Optuna studies (lmcore.search.study_storage: local_cluster)


def sweeps_storage(layout: Layout | None = None) -> StorageRef:
    """The local cluster's database for searches' studies: a database and user of their own on the
    MariaDB that accounting runs on, made here when missing (a cluster started before searches
    existed gets them at its first search). Its password lives in a 0600 file beside the cluster's
    configuration; the URL says none."""
    layout = layout or Layout.default()
    settings = _load_settings(layout)
    if settings is None or not is_up(layout):
        raise ClusterError(f"the local cluster in {layout.root} is not running: `lmlaunch cluster up`")
    if not settings.accounting:
        raise ClusterError("the local cluster runs without accounting, so without MariaDB, where searches keep "
                           "their studies: `lmlaunch cluster up --accounting` (or give the profile a "
                           "sweep_storage journal file)")
    pw_file = layout.etc / "sweeps-db-password"
    if not pw_file.exists():
        tmp = pw_file.with_suffix(".tmp")
        tmp.write_text(secrets.token_hex(16) + "\n")
        tmp.chmod(0o600)
        tmp.rename(pw_file)
    password = pw_file.read_text().strip()
    port = settings.ports.mariadb
    sql = (
        f"CREATE DATABASE IF NOT EXISTS {SWEEPS_DB};"
        f"CREATE USER IF NOT EXISTS '{SWEEPS_DB}'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"ALTER USER '{SWEEPS_DB}'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"GRANT ALL ON {SWEEPS_DB}.* TO '{SWEEPS_DB}'@'127.0.0.1';"
    )
    run_checked([_which("mariadb") or "mariadb", "--no-defaults", f"--socket={layout.mysql_socket}", "-u", "root",
                 "-e", sql], "creating the sweeps' database")  # idempotent: each search start or resume
    return StorageRef("rdb", f"mysql+pymysql://{SWEEPS_DB}@127.0.0.1:{port}/{SWEEPS_DB}", str(pw_file))


def _mariadb_dirs(layout: Layout) -> Path:
    """MariaDB's data, run and temporary directories, owned by mysql when root; returns the
    temporary one (its own: two clusters' MariaDB name their temporary tables alike)."""
    for d in (layout.mysql, layout.mysql_data, layout.mysql_run):
        d.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(d, "mysql", "mysql")
        d.chmod(0o750 if d != layout.mysql_run else 0o755)
    tmp = layout.mysql / "tmp"
    tmp.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(tmp, "mysql", "mysql")
    return tmp


def _install_mariadb(layout: Layout, user: list[str], tmp: Path) -> None:
    """A fresh data directory (one bootstrap at a time on the machine); a failed one is removed,
    so that the next `up` starts it afresh."""
    try:
        with flocked(primary_root() / ".mariadb-install.lock"):
            run_checked(
                [
                    _which("mariadb-install-db") or "mariadb-install-db",
                    "--no-defaults",
                    *user,
                    f"--datadir={layout.mysql_data}",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                "mariadb-install-db",
                env={**_sbin_env(), "TMPDIR": str(tmp)},
                timeout=300,
            )
    except ClusterError:
        shutil.rmtree(layout.mysql_data / "mysql", ignore_errors=True)
        raise


def _start_mariadb(layout: Layout, ports: Ports, user: list[str], tmp: Path) -> None:
    log = layout.logfile("mariadb")
    spawn(
        [
            _which("mariadbd") or "mariadbd",
            "--no-defaults",
            *user,
            f"--datadir={layout.mysql_data}",
            f"--socket={layout.mysql_socket}",
            f"--pid-file={layout.pidfile('mariadb')}",
            f"--port={ports.mariadb}",
            "--bind-address=127.0.0.1",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=64M",
            "--innodb-lock-wait-timeout=900",
            f"--tmpdir={tmp}",
            f"--log-error={log}",
        ],
        env=_sbin_env(),
    )
    if os.geteuid() == 0:
        log.touch(exist_ok=True)
        shutil.chown(log, "mysql", "mysql")
    wait_until(
        lambda: layout.mysql_socket.exists() and port_open(ports.mariadb), 90, "MariaDB", log
    )


def _conf_env(layout: Layout) -> dict[str, str]:
    # SLURM_CONF makes slurmdbd find slurmdbd.conf next to our slurm.conf
    return {**_sbin_env(), "SLURM_CONF": str(layout.slurm_conf)}


def ensure_slurmdbd(layout: Layout, ports: Ports, say: Say) -> None:
    if running_from_pidfile(layout.pidfile("slurmdbd")) and port_open(ports.slurmdbd):
        return
    say(f"starting slurmdbd on 127.0.0.1:{ports.slurmdbd}")
    run_checked([_which("slurmdbd") or "slurmdbd"], "slurmdbd", env=_conf_env(layout))
    wait_until(lambda: port_open(ports.slurmdbd), 60, "slurmdbd", layout.logfile("slurmdbd"))


def register_accounting(say: Say) -> None:
    """cluster, account and users in the accounting database (idempotent)."""
    existing = slurm.sacctmgr(["list", "cluster", "format=Cluster", "-n", "-P"])
    if CLUSTER_NAME not in existing.split():
        say(f"registering cluster '{CLUSTER_NAME}' with slurmdbd")
        slurm.sacctmgr(["add", "cluster", CLUSTER_NAME])
    # only what is missing: 24.11 exits 1 on adding what exists, with messages 22.05 never printed
    accounts = slurm.sacctmgr(["list", "account", "format=Account", "-n", "-P"]).split()
    if "lmlaunch" not in accounts:
        slurm.sacctmgr(["add", "account", "lmlaunch", f"cluster={CLUSTER_NAME}", "Description=lmlaunch",
                        "Organization=lmlaunch"])
    users = {slurm.user_name(), "root"}
    if os.environ.get("SUDO_USER"):
        users.add(os.environ["SUDO_USER"])
    assoc = slurm.sacctmgr(["list", "assoc", f"cluster={CLUSTER_NAME}", "format=User,Account", "-n", "-P"])
    have = {tuple(line.split("|")[:2]) for line in assoc.splitlines() if "|" in line}
    for u in sorted(users):
        if (u, "lmlaunch") not in have:
            slurm.sacctmgr(["add", "user", u, "account=lmlaunch", f"cluster={CLUSTER_NAME}"])


# --------------------------------------------------------------------------- slurmctld + slurmd


def _conf_is_ours(layout: Layout) -> bool:
    return SYSTEM_SLURM_CONF.is_symlink() and os.readlink(SYSTEM_SLURM_CONF) == str(layout.slurm_conf)


def install_system_conf(layout: Layout, say: Say) -> None:
    """Link /etc/slurm/slurm.conf to ours so every SLURM command finds it: the CLI, tests, the
    jobs and srun inside them, without anyone exporting SLURM_CONF."""
    if os.geteuid() != 0 or _conf_is_ours(layout):
        return
    if SYSTEM_SLURM_CONF.exists() or SYSTEM_SLURM_CONF.is_symlink():
        say(
            f"note: {SYSTEM_SLURM_CONF} exists and is not the local cluster's; SLURM commands use it "
            f"unless SLURM_CONF={layout.slurm_conf} is exported"
        )
        return
    SYSTEM_SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
    SYSTEM_SLURM_CONF.symlink_to(layout.slurm_conf)


def ensure_hosts(say: Say, names: Sequence[str] = NODES) -> None:
    """The node names must resolve: Lightning's MASTER_ADDR is the first node of SLURM_NODELIST."""
    import socket

    unresolved = []
    for n in names:
        try:
            socket.gethostbyname(n)
        except OSError:
            unresolved.append(n)
    if not unresolved:
        return
    hosts = Path("/etc/hosts")
    if os.geteuid() != 0:
        raise UserError(
            f"node names {', '.join(unresolved)} do not resolve; as root add to /etc/hosts:\n"
            f"  127.0.0.1 {' '.join(unresolved)}",
            exit_code=1,
        )
    say(f"adding '127.0.0.1 {' '.join(unresolved)}' to /etc/hosts")
    with hosts.open("a") as f:
        f.write(f"127.0.0.1 {' '.join(unresolved)}  {HOSTS_MARKER}\n")


UP_STATES = {"idle", "mix", "alloc", "comp", "resv", "plnd"}  # sinfo's words for a node whose slurmd answers


def nodes_ready(names: Sequence[str] = NODES) -> bool:
    """Every node's daemon up: idle, mixed, allocated, completing, reserved (a reservation a killed
    test run left behind is scheduling, not a daemon down) or planned, and none unresponsive (``*``)."""
    try:
        info = {n.name: n.state for n in slurm.nodes(timeout=10)}
    except (SlurmUnavailable, UserError):
        return False
    return all(info.get(n, "").rstrip("*~#") in UP_STATES for n in names) and not any(
        info.get(n, "").endswith("*") for n in names
    )


def ensure_slurmctld(layout: Layout, say: Say) -> None:
    if running_from_pidfile(layout.pidfile("slurmctld")) and slurm.ping(timeout=5):
        return
    say("starting slurmctld")
    run_checked([_which("slurmctld") or "slurmctld", "-f", str(layout.slurm_conf)], "slurmctld", env=_conf_env(layout))
    wait_until(lambda: slurm.ping(timeout=5), 60, "slurmctld", layout.logfile("slurmctld"), poll=0.5)


def ensure_slurmd(layout: Layout, say: Say, names: Sequence[str] = NODES) -> None:
    for old in sorted(layout.run.glob("slurmd-n*.pid")):  # nodes a smaller `--nodes` left out
        name = old.name.removeprefix("slurmd-").removesuffix(".pid")
        if name not in names:
            line = stop(old, f"slurmd {name}")
            if line:
                say(line)
    for n in names:
        if running_from_pidfile(layout.run / f"slurmd-{n}.pid"):
            continue
        (layout.spool / f"slurmd-{n}").mkdir(parents=True, exist_ok=True)
        say(f"starting slurmd -N {n}")
        run_checked([_which("slurmd") or "slurmd", "-N", n, "-f", str(layout.slurm_conf)], f"slurmd {n}", env=_conf_env(layout))
    log = layout.log / "slurmd-n1.log"
    what = f"nodes {', '.join(names)} (idle in sinfo)"
    try:
        wait_until(lambda: nodes_ready(names), 60, what, log, poll=0.5)
    except ClusterError:
        # nodes left DOWN/DRAIN by an earlier crash: resume them once and wait again
        for n in names:
            slurm.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"], check=False)
        wait_until(lambda: nodes_ready(names), 30, what, log, poll=0.5)


def start_daemon(layout: Layout, daemon: str, say: Say, node: str | None = None) -> None:
    """One daemon of the cluster at ``layout`` started again if it is not running (after a crash, or
    a test's fault), nothing else touched: ``slurmctld``, ``slurmdbd``, or ``node``'s ``slurmd``
    (waited for until it listens; the node's state is the controller's to give). On the cluster's
    own SLURM: inside its Debian root for another release's."""
    settings = _load_settings(layout)
    if settings is None or not layout.slurm_conf.exists():
        raise ClusterError(f"no cluster was started at {layout.root}: `lmlaunch cluster up` first")
    if not is_native(settings.version) and not debian_root.inside_root():
        from launcher.localcluster import other_release

        other_release.start_daemon(str(settings.version), layout, daemon, say, node)
        return
    with own_conf(layout):
        if daemon == "slurmctld":
            ensure_slurmctld(layout, say)
        elif daemon == "slurmdbd":
            ensure_slurmdbd(layout, settings.ports, say)
        elif daemon == "slurmd" and node in settings.ports.node_names:
            port = settings.ports.nodes[settings.ports.node_names.index(node)]
            if not running_from_pidfile(layout.run / f"slurmd-{node}.pid"):
                (layout.spool / f"slurmd-{node}").mkdir(parents=True, exist_ok=True)
                say(f"starting slurmd -N {node}")
                run_checked([_which("slurmd") or "slurmd", "-N", node, "-f", str(layout.slurm_conf)], f"slurmd {node}",
                            env=_conf_env(layout))
            wait_until(lambda: port_open(port), 60, f"slurmd {node} on port {port}", layout.log / f"slurmd-{node}.log")
        else:
            raise UserError(f"start_daemon: {daemon!r} (node {node!r}); slurmctld, slurmdbd, or slurmd with one of "
                            f"{', '.join(settings.ports.node_names)}")


# --------------------------------------------------------------------------- up / down / status


def _given(value: T | None, kept: T) -> T:
    return kept if value is None else value


def _load_settings(layout: Layout) -> Settings | None:
    try:
        return Settings.from_json(layout.settings.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _node_names(layout: Layout) -> tuple[str, ...]:
    settings = _load_settings(layout)
    return settings.ports.node_names if settings is not None else NODES


def _our_daemons(layout: Layout) -> dict[str, Path]:
    files = {"slurmctld": layout.pidfile("slurmctld")}
    files.update({f"slurmd {n}": layout.run / f"slurmd-{n}.pid" for n in _node_names(layout)})
    if restd.runs_rest(layout):
        files["slurmrestd"] = layout.pidfile("slurmrestd")
    files["slurmdbd"] = layout.pidfile("slurmdbd")
    files["mariadb"] = layout.pidfile("mariadb")
    files["munged"] = layout.pidfile("munged")
    return files


def is_up(layout: Layout) -> bool:
    """All daemons of ours alive, the controller answering and both nodes usable."""
    daemons = _our_daemons(layout)
    daemons.pop("munged")  # may be the system's
    settings = _load_settings(layout)
    if settings is not None and not settings.accounting:
        daemons.pop("slurmdbd")
        daemons.pop("mariadb")
    if not all(running_from_pidfile(p) for p in daemons.values()):
        return False
    with own_conf(layout):
        return slurm.ping(timeout=5) and nodes_ready(_node_names(layout))


def up(
    say: Say,
    *,
    preempt_send_user_signal: bool | None = None,
    layout: Layout | None = None,
    ports: Ports | None = None,
    system_conf: bool | None = None,
    accounting: bool | None = None,
    min_job_age: int | None = None,
    version: str | None = None,
    nodes: int | None = None,
    topology: str | None = None,
    gpus: str | None = None,
) -> bool:
    """Start the cluster; True when it was already running (and nothing had to change).

    ``version`` picks the SLURM: the machine's own (None) or the other Debian release's, which
    runs in a Debian root (other_release.py). Settings not given keep what the last `up` of this
    state directory was given (its ports, ``nodes`` count, ``topology`` and ``gpus`` included; "none"
    drops either), else the defaults. Two `up`s of one cluster
    never race (a lock in its directory); the machine-wide steps (packages, munged, /etc/hosts)
    are locked across clusters."""
    layout = layout or (Layout.default() if version is None else Layout(primary_root(version)))
    loaded = _load_settings(layout)
    if version is None and loaded is not None:
        version = loaded.version  # a cluster keeps its SLURM: a later `up` of it need not name it
    if version is not None and is_native(version) and not debian_root.inside_root():
        version = None  # inside its root a cluster keeps the version it was started as
    current = loaded or Settings(ports=Ports.for_slot(0, version), version=version)
    base = _given(ports, current.ports)
    topo, nodes = _wanted_topology(topology, current, base, nodes)
    wanted = Settings(
        preempt_send_user_signal=_given(preempt_send_user_signal, current.preempt_send_user_signal),
        ports=base if nodes is None else base.with_nodes(nodes),
        system_conf=_given(system_conf, current.system_conf),
        accounting=_given(accounting, current.accounting),
        min_job_age=_given(min_job_age, current.min_job_age),
        version=version,
        topology=topo.text if topo else None,
        gpus=_wanted_gpus(gpus, current),
    )
    root = None
    if version is not None and not is_native(version):
        from launcher.localcluster import other_release

        root = other_release.ensure_root(version, say)  # its packages and mounts, even under a running cluster
    if current == wanted and layout.slurm_conf.exists() and is_up(layout):
        return True
    for d in (layout.root, layout.etc, layout.run, layout.log, layout.ctld_state, layout.spool):
        d.mkdir(parents=True, exist_ok=True)
    if version is not None and root is not None:
        return other_release.up(version, root, layout, wanted, say)
    with flocked(layout.up_lock), own_conf(layout):
        return _up(say, layout, wanted)


def _wanted_topology(given: str | None, current: Settings, ports: Ports,
                     nodes: int | None) -> tuple[LocalTopology | None, int | None]:
    """The topology this `up` runs (``given``, else the one kept) and the node count it implies;
    ``ports`` are those this `up` starts from (given, else kept), whose node count the topology
    overrides: ports given for 2 nodes with a topology of 8 are the 8 nodes' ports."""
    text = given if given is not None else current.topology
    count = nodes if nodes is not None or (text and "x" in text) else len(ports.nodes)
    try:
        topo = parse_topology(text, count)
    except ValueError as exc:
        kept = "" if given is not None else " (kept from the last `up`; `--topology none` drops it)"
        raise UserError(f"{exc}{kept}") from None
    if topo is not None and not 1 <= topo.nodes <= MAX_NODES:
        raise UserError(f"--topology {topo.text}: {topo.nodes} nodes; the local cluster runs 1 to {MAX_NODES}")
    if topo is not None and nodes is None and topo.nodes != len(ports.nodes):
        nodes = topo.nodes
    return topo, nodes


def _wanted_gpus(given: str | None, current: Settings) -> str | None:
    """The GPUs a node this `up` declares (``given``, else the ones kept), as Settings keeps them."""
    text = given if given is not None else current.gpus
    try:
        parsed = parse_gpus(text)
    except ValueError as exc:
        kept = "" if given is not None else " (kept from the last `up`; `--gpus none` drops it)"
        raise UserError(f"{exc}{kept}") from None
    return parsed.text if parsed else None


def _write_gres(layout: Layout, wanted: Settings) -> str | None:
    """gres.conf and the fake GPUs' device files for ``wanted`` (or neither); a node's Gres=."""
    gpus = parse_gpus(wanted.gpus)
    make_devices(gpus, layout.root, wanted.ports.node_names)
    if gpus is None:
        layout.gres_conf.unlink(missing_ok=True)
        return None
    layout.gres_conf.write_text(gpus.render_gres_conf(layout.root, wanted.ports.node_names))
    return gpus.gres


def _write_topology(layout: Layout, wanted: Settings) -> str | None:
    """topology.conf for ``wanted`` (or none); the plugin slurm.conf names."""
    topo = parse_topology(wanted.topology, len(wanted.ports.nodes))
    if topo is None:
        layout.topology_conf.unlink(missing_ok=True)
        return None
    problem = version_problem(topo, native_version())
    if problem:
        raise UserError(problem)
    layout.topology_conf.write_text(topo.render(wanted.ports.node_names))
    return topo.plugin


def _write_slurm_conf(layout: Layout, wanted: Settings, user: str, say: Say) -> list[str]:
    """slurm.conf for ``wanted``, with what this SLURM offers beyond the basics (restd.py: JWT auth
    for slurmrestd, the expedited requeue, the controller's metrics); the JWT auth lines (empty:
    no slurmrestd). Daemons that must read a new auth setting at start are stopped (`up` starts them)."""
    plugin = _write_topology(layout, wanted)
    node_gres = _write_gres(layout, wanted)
    rest = restd.rest_available()
    new_auth = rest and not restd.runs_rest(layout)  # auth plugins are read at start only
    if rest:
        restd.ensure_key(layout)
    auth = restd.auth_lines(layout) if rest else []
    layout.slurm_conf.write_text(render_slurm_conf(
        layout, user=user, preempt_send_user_signal=wanted.preempt_send_user_signal, ports=wanted.ports,
        accounting=wanted.accounting, min_job_age=wanted.min_job_age, topology_plugin=plugin,
        ctld_parameters=restd.ctld_parameters(), extra_lines=auth + restd.controller_lines(), node_gres=node_gres))
    if new_auth:
        for pidfile in [layout.pidfile("slurmctld"), layout.pidfile("slurmdbd"), *sorted(layout.run.glob("slurmd-n*.pid"))]:
            line = stop(pidfile, pidfile.stem)
            if line:
                say(line + " (JWT auth for slurmrestd: read at start only)")
    return auth


def _up(say: Say, layout: Layout, wanted: Settings) -> bool:
    current = _load_settings(layout)  # again: another `up` may have finished while this one waited
    if current == wanted and is_up(layout):
        return True
    ports = wanted.ports
    user = slurm.user_name()
    layout.root.chmod(0o755)  # the mysql user must traverse to its own directory
    layout.etc.chmod(0o755)
    with flocked(primary_root() / ".machine.lock"):
        ensure_packages(say)
        ensure_munge(say)
        ensure_hosts(say, ports.node_names)
    auth = _write_slurm_conf(layout, wanted, user, say)
    rest = bool(auth)
    if wanted.system_conf:
        install_system_conf(layout, say)
    if wanted.accounting:
        password = _db_password(layout)
        dbd = layout.slurmdbd_conf
        dbd.write_text(render_slurmdbd_conf(layout, user=user, db_password=password, ports=ports, extra_lines=auth))
        dbd.chmod(0o600)  # slurmdbd refuses a readable config; it holds the DB password
        ensure_mariadb(layout, ports, password, say)
        ensure_slurmdbd(layout, ports, say)
        register_accounting(say)
    else:
        for name in ("slurmdbd", "mariadb"):  # a cluster without accounting runs neither
            line = stop(layout.pidfile(name), name)
            if line:
                say(line)
    controller_was_up = running_from_pidfile(layout.pidfile("slurmctld")) and slurm.ping(timeout=5)
    if controller_was_up and current is not None and current.accounting != wanted.accounting:
        # the accounting plugin is read at start only: `scontrol reconfigure` keeps the old one
        say("restarting slurmctld (accounting " + ("on" if wanted.accounting else "off") + ")")
        stop(layout.pidfile("slurmctld"), "slurmctld")
        controller_was_up = False
    if current is not None and _node_shape(current) != _node_shape(wanted):
        # node definitions, their GPUs and the topology plugin are read at start only, by the controller and
        # every slurmd: whichever of them runs is restarted, the controller answering or not (a slurmd
        # left running with the old GPUs reports none, and the controller marks its node INVAL)
        running = [p for p in [layout.pidfile("slurmctld"), *sorted(layout.run.glob("slurmd-n*.pid"))]
                   if running_from_pidfile(p)]
        if running:
            say(f"restarting slurmctld and the slurmds (nodes {', '.join(ports.node_names)}, topology "
                f"{wanted.topology or 'none'}, GPUs {wanted.gpus or 'none'})")
        for pidfile in running:
            stop(pidfile, pidfile.stem)
        controller_was_up = False
    ensure_slurmctld(layout, say)
    if controller_was_up and current != wanted:
        say("reconfiguring slurmctld (its settings changed)")
        slurm.run(["scontrol", "reconfigure"])
    ensure_slurmd(layout, say, ports.node_names)
    if rest:
        restd.ensure_slurmrestd(layout, ports.slurmctld, say)
    layout.settings.write_text(wanted.to_json())
    return False


def _node_shape(settings: Settings) -> tuple[object, ...]:
    return settings.ports.nodes, settings.topology, settings.gpus


def worker_layouts(version: str | None = None) -> list[Layout]:
    """The worker clusters' state directories of a SLURM version on this machine (started or not)."""
    return [w for k in range(1, MAX_WORKER_SLOTS + 1) if (w := Layout.worker(k, version)).settings.exists()]


def tagged(say: Say, tag: str) -> Say:
    return lambda line: say(f"{tag}: {line}")


def down(say: Say, *, layout: Layout | None = None, version: str | None = None) -> list[str]:
    """Stop the daemons `up` started, by their pid files (controller and nodes first). Stopping
    a version's primary cluster stops the worker clusters beside it too, and for a cluster in a
    Debian root its munged and the root's mounts."""
    primary = primary_root(version)
    layout = layout or (Layout.default() if is_native(version) else Layout(primary))
    stopped = []
    if layout.root == primary:
        for worker in worker_layouts(version):
            stopped += [f"{worker.root.name} {name}" for name in down(tagged(say, worker.root.name), layout=worker)]
    for name, pidfile in _our_daemons(layout).items():
        if name == "munged" and layout.root != primary:
            continue  # the machine's (or the root's) munged serves the primary cluster too
        line = stop(pidfile, name)
        if line:
            say(line)
            stopped.append(name)
    if remove_devices(layout.root):
        say("removed the fake GPUs' device files")
    if layout.root == primary and version is not None and not is_native(version):
        from launcher.localcluster import other_release

        other_release.release_root(version, say)
    return stopped


@dataclass(frozen=True)
class Status:
    state_dir: str
    daemons: dict[str, int | None]  # name -> pid (None: not running)
    controller: bool
    nodes: list[slurm.NodeInfo]
    partitions: list[slurm.PartitionInfo]
    settings: Settings | None
    problem: str | None


def status(layout: Layout | None = None) -> Status:
    layout = layout or Layout.default()
    daemons = {name: running_from_pidfile(p) for name, p in _our_daemons(layout).items()}
    nodes: list[slurm.NodeInfo] = []
    parts: list[slurm.PartitionInfo] = []
    problem = None
    with own_conf(layout):
        controller = slurm.ping(timeout=5)
        if controller:
            try:
                nodes = slurm.nodes(timeout=10)
                parts = slurm.partitions(timeout=10)
            except (SlurmUnavailable, UserError) as exc:
                problem = exc.message
    return Status(str(layout.root), daemons, controller, nodes, parts, _load_settings(layout), problem)


__all__ = ["up", "down", "status", "is_up", "Layout", "Ports", "Settings", "alive"]
