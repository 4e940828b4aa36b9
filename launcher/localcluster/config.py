"""Where the local cluster keeps its state, and its slurm.conf / slurmdbd.conf (pure rendering)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lmcore.slurm import versions

CLUSTER_NAME = "lmlaunch"
MAX_NODES = 64  # `cluster up --nodes N`: virtual nodes n1..nN, each a slurmd on this machine


def node_names(count: int) -> tuple[str, ...]:
    return tuple(f"n{i}" for i in range(1, count + 1))


NODES = node_names(2)  # the default cluster's
# Each virtual node declares more CPUs than the 2-core machine has (SlurmdParameters=
# config_overrides): a 2-node x 1-task job, a preempting high-priority job and a few concurrent
# test jobs can all be placed. The CPUs are shared; declaring them keeps the scheduler honest
# about how many tasks run at once, not about speed.
CPUS_PER_NODE = 4
REAL_MEMORY_MB = 4096
LOW_GRACE_SECONDS = 30
MAX_TIME = "2:00:00"


# Worker clusters (one per parallel test worker, launcher/localcluster/workers.py) sit beside the
# primary one: slot K's ports are the primary's + K x PORT_STRIDE, its state under workers/wK.
PORT_STRIDE = 100
MAX_WORKER_SLOTS = 16

# The SLURM each Debian release's packages give. The local cluster runs the machine's own release
# natively and the others each from a Debian root made by debootstrap (launcher/localcluster/
# debian_root.py): each one's state under <primary>/slurm-<version>, its ports the native ones +
# OTHER_RELEASE_PORT_OFFSET x K (past every worker slot's) for the K-th release that is not the
# machine's. Debian unstable (sid) carries the newest SLURM; its releases that a machine runs
# natively come first, so `other_version` stays the other stable release's.
SLURM_RELEASES = {r.name: r.debian for r in versions.RELEASES}  # lmcore.slurm.versions: one entry a release
OTHER_RELEASE_PORT_OFFSET = 5000  # 24.11 or 22.05 at +5000, 26.05 at +10000: all below the rendezvous ports (20000+)
MIN_JOB_AGE_FLOOR = 2  # slurm.conf(5): "the minimum non-zero value for MinJobAge recommended is 2"


def debian_release(os_release: Path = Path("/etc/os-release")) -> str | None:
    """This machine's Debian codename (bookworm, trixie; sid for unstable, which names the next
    release's codename in VERSION_CODENAME and says sid only in PRETTY_NAME), or None elsewhere."""
    try:
        fields = dict(line.partition("=")[::2] for line in os_release.read_text().splitlines())
        if "/sid" in fields.get("PRETTY_NAME", ""):
            return "sid"
        for key, value in fields.items():
            if key == "VERSION_CODENAME":
                return value.strip().strip('"') or None
    except OSError:
        pass
    return None


def native_version() -> str | None:
    """The SLURM version apt installs on this machine (None: not a Debian release we know)."""
    release = debian_release()
    return next((v for v, r in SLURM_RELEASES.items() if r == release), None)


def other_version() -> str | None:
    """The other stable Debian release's SLURM, which this machine runs from a Debian root (the
    suite's second phase); 26.05 from sid is asked for by name."""
    native = native_version()
    return next((v for v in SLURM_RELEASES if v != native), None) if native else None


def is_native(version: str | None) -> bool:
    return version is None or version == native_version()


def _release_index(version: str | None) -> int:
    """0 for the machine's own SLURM; K for the K-th other release (SLURM_RELEASES' order)."""
    if is_native(version):
        return 0
    others = [v for v in SLURM_RELEASES if not is_native(v)]
    return others.index(version) + 1 if version in others else len(others) + 1


@dataclass(frozen=True)
class Ports:
    slurmctld: int = 6817
    slurmdbd: int = 6819
    mariadb: int = 3316  # not 3306: a system MariaDB may own that
    nodes: tuple[int, ...] = (6821, 6822)

    @classmethod
    def for_slot(cls, slot: int, version: str | None = None) -> Ports:
        """The primary cluster's ports (slot 0) shifted for worker cluster ``slot``, and past all
        of the native release's when ``version`` is the other release's SLURM."""
        base, k = cls(), slot * PORT_STRIDE + OTHER_RELEASE_PORT_OFFSET * _release_index(version)
        return cls(base.slurmctld + k, base.slurmdbd + k, base.mariadb + k, tuple(p + k for p in base.nodes))

    def with_nodes(self, count: int) -> Ports:
        """``count`` nodes, their slurmd ports one after another from the first node's."""
        if not 1 <= count <= MAX_NODES:
            raise ValueError(f"--nodes {count}: the local cluster runs 1 to {MAX_NODES} virtual nodes")
        return Ports(self.slurmctld, self.slurmdbd, self.mariadb, tuple(self.nodes[0] + i for i in range(count)))

    @property
    def node_names(self) -> tuple[str, ...]:
        return node_names(len(self.nodes))

    def to_json(self) -> dict[str, object]:
        return {"slurmctld": self.slurmctld, "slurmdbd": self.slurmdbd, "mariadb": self.mariadb, "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Ports:
        nodes = d["nodes"]
        if not isinstance(nodes, list):
            raise TypeError(f"ports.nodes must be a list of ports, not {nodes!r}")
        return cls(int(str(d["slurmctld"])), int(str(d["slurmdbd"])), int(str(d["mariadb"])), tuple(int(n) for n in nodes))


@dataclass(frozen=True)
class Settings:
    """What `up` was asked for, kept in the state directory: a later `up` keeps it."""

    preempt_send_user_signal: bool = False
    ports: Ports = field(default_factory=Ports)
    # the primary cluster links /etc/slurm/slurm.conf to its own; a worker cluster never does
    system_conf: bool = True
    # slurmdbd on MariaDB (sacct, sacctmgr); off: a cluster without accounting, as some sites run
    accounting: bool = True
    # how long the controller keeps a finished job (squeue, scontrol show job): SLURM's default
    # 300 s, or as little as MIN_JOB_AGE_FLOOR, as on sites that purge finished jobs at once
    min_job_age: int = 300
    # the SLURM version when it is not the machine's own (the cluster runs in a Debian root)
    version: str | None = None
    # `--topology` as topology.py reads it (tree:GxN, block:GxN); None: no topology plugin
    topology: str | None = None
    # `--gpus` as gpus.py reads it (TYPE:N a node); None: CPU-only nodes
    gpus: str | None = None

    def to_json(self) -> str:
        return json.dumps({"preempt_send_user_signal": self.preempt_send_user_signal,
                           "ports": self.ports.to_json(), "system_conf": self.system_conf,
                           "accounting": self.accounting, "min_job_age": self.min_job_age,
                           "version": self.version, "topology": self.topology, "gpus": self.gpus}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Settings:
        d = json.loads(text)
        ports = Ports.from_json(d["ports"]) if "ports" in d else Ports()  # settings written before ports were kept
        return cls(bool(d.get("preempt_send_user_signal", False)), ports, bool(d.get("system_conf", True)),
                   bool(d.get("accounting", True)), int(d.get("min_job_age", 300)), d.get("version"), d.get("topology"),
                   d.get("gpus"))



def base_root() -> Path:
    """Where every local cluster of this machine keeps its state."""
    if os.geteuid() == 0:
        return Path("/var/lib/lmlaunch-cluster")
    return Path.home() / ".lmlaunch" / "cluster"


def primary_root(version: str | None = None) -> Path:
    """The primary local cluster of a SLURM version (the one /etc/slurm/slurm.conf names where it
    runs): the machine's own release's at the base, another release's under ``slurm-<version>``.
    Inside a Debian root, LMLAUNCH_CLUSTER_PRIMARY names it (debian_root.py sets it)."""
    if is_native(version) and os.environ.get("LMLAUNCH_CLUSTER_PRIMARY"):
        return Path(os.environ["LMLAUNCH_CLUSTER_PRIMARY"])
    return base_root() if is_native(version) else base_root() / f"slurm-{version}"


@dataclass(frozen=True)
class Layout:
    """Every path the cluster writes, under one state directory."""

    root: Path

    @classmethod
    def default(cls) -> Layout:
        explicit = os.environ.get("LMLAUNCH_CLUSTER_DIR")
        if explicit:
            return cls(Path(explicit).expanduser().absolute())
        return cls(primary_root())

    @classmethod
    def worker(cls, slot: int, version: str | None = None) -> Layout:
        """Worker cluster ``slot`` (1..MAX_WORKER_SLOTS), whatever LMLAUNCH_CLUSTER_DIR says."""
        return cls(primary_root(version) / "workers" / f"w{slot}")

    @property
    def bin(self) -> Path:
        """The SLURM client commands of a cluster that runs in a Debian root (wrappers that enter
        it); absent for the machine's own SLURM."""
        return self.root / "bin"

    @property
    def up_lock(self) -> Path:
        """Held (flock) while `up` starts or reconfigures this cluster: two `up`s never race."""
        return self.root / ".up.lock"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        # as topology.conf: read from the directory of the slurm.conf
        return self.etc / "gres.conf"

    @property
    def topology_conf(self) -> Path:
        # SLURM reads topology.conf from the directory of the slurm.conf it was given
        return self.etc / "topology.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        # slurmdbd finds slurmdbd.conf next to the slurm.conf named by SLURM_CONF
        return self.etc / "slurmdbd.conf"

    @property
    def settings(self) -> Path:
        return self.etc / "settings.json"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def ctld_state(self) -> Path:
        return self.root / "ctld"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def mysql(self) -> Path:
        return self.root / "mysql"  # owned by the mysql user

    @property
    def mysql_data(self) -> Path:
        return self.mysql / "data"

    @property
    def mysql_run(self) -> Path:
        return self.mysql / "run"  # socket + pid: a directory the mysql user owns

    @property
    def mysql_socket(self) -> Path:
        return self.mysql_run / "mysqld.sock"

    def pidfile(self, daemon: str) -> Path:
        """Pid files of the daemons `up` started (`down` stops exactly these)."""
        if daemon == "mariadb":
            return self.mysql_run / "mariadbd.pid"
        return self.run / f"{daemon}.pid"

    def logfile(self, daemon: str) -> Path:
        return self.log / f"{daemon}.log"


def controller_hostname() -> str:
    """slurmctld and slurmdbd refuse to start unless their Host matches the short hostname."""
    return socket.gethostname().split(".")[0]


def render_slurm_conf(layout: Layout, *, user: str, preempt_send_user_signal: bool, ports: Ports = Ports(),
                      accounting: bool = True, min_job_age: int = 300, topology_plugin: str | None = None,
                      ctld_parameters: Sequence[str] = (), extra_lines: Sequence[str] = (),
                      node_gres: str | None = None) -> str:
    """``ctld_parameters``: SlurmctldParameters words beyond preempt_send_user_signal; ``extra_lines``:
    what a newer SLURM's cluster adds (restd.py: JWT auth, the controller's metrics); ``node_gres``:
    each node's GPUs (``gpu:h100:4``, gres.conf beside this file: gpus.py)."""
    host = controller_hostname()
    lines = [*_daemon_lines(layout, host, user, ports), *_POLICY_LINES, f"MinJobAge={min_job_age}", *_TIMEOUT_LINES]
    if topology_plugin:  # its topology.conf beside this file (launcher/localcluster/topology.py)
        lines.append(f"TopologyPlugin={topology_plugin}")
    if accounting:  # real accounting (slurmdbd on MariaDB): sacct states, attempts with sacct -D
        lines += ["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
                  f"AccountingStoragePort={ports.slurmdbd}"]
        if node_gres:  # sacct's AllocTRES names GPUs only when they are tracked (slurm.conf(5))
            lines.append("AccountingStorageTRES=gres/gpu,gres/gpu:" + node_gres.split(":")[1])
    else:  # as a site without slurmdbd: sacct and sacctmgr fail, squeue is all there is
        lines.append("AccountingStorageType=accounting_storage/none")
    words = (["preempt_send_user_signal"] if preempt_send_user_signal else []) + list(ctld_parameters)
    if words:
        lines.append("SlurmctldParameters=" + ",".join(words))
    lines += extra_lines
    if node_gres:
        lines.append("GresTypes=gpu")
    gres = f" Gres={node_gres}" if node_gres else ""
    for name, port in zip(ports.node_names, ports.nodes):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE} RealMemory={REAL_MEMORY_MB}{gres} State=UNKNOWN"
        )
    nodes = ",".join(ports.node_names)
    lines.append(
        f"PartitionName=low Nodes={nodes} Default=YES MaxTime={MAX_TIME} State=UP "
        f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={LOW_GRACE_SECONDS}"
    )
    lines.append(f"PartitionName=high Nodes={nodes} Default=NO MaxTime={MAX_TIME} State=UP PriorityTier=10 PreemptMode=OFF")
    return "\n".join(lines) + "\n"


def _daemon_lines(layout: Layout, host: str, user: str, ports: Ports) -> list[str]:
    """Who the daemons are, where they listen, keep their state and log."""
    r = layout.root
    return [
        "# Written by `lmlaunch cluster up` (launcher/localcluster); rewritten on every `up`.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        f"SlurmctldPort={ports.slurmctld}",
        "AuthType=auth/munge",
        "CryptoType=crypto/munge",
        f"StateSaveLocation={layout.ctld_state}",
        f"SlurmdSpoolDir={layout.spool}/slurmd-%n",
        f"SlurmctldPidFile={layout.pidfile('slurmctld')}",
        f"SlurmdPidFile={r}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={layout.logfile('slurmctld')}",
        f"SlurmdLogFile={r}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]


# How the cluster runs jobs: one machine, real preemption.
_POLICY_LINES = (
    # one machine, no cgroups inside containers: track processes by parent pid
    "ProctrackType=proctrack/linuxproc",
    "TaskPlugin=task/none",
    "MpiDefault=none",
    "MailProg=/bin/true",  # --mail-type is accepted; nothing is mailed from this machine
    "ReturnToService=2",
    "SchedulerType=sched/backfill",
    "SchedulerParameters=bf_interval=5",
    "SelectType=select/cons_tres",
    "SelectTypeParameters=CR_CPU",
    # the virtual nodes declare more CPUs than the machine has
    "SlurmdParameters=config_overrides",
    # real preemption: a job on `high` requeues the `low` jobs in its way
    "PreemptType=preempt/partition_prio",
    "PreemptMode=REQUEUE",
    "JobRequeue=1",
)
_TIMEOUT_LINES = (
    "KillWait=10",
    "InactiveLimit=0",
    "SlurmctldTimeout=60",
    "SlurmdTimeout=60",
    "MessageTimeout=20",
    "JobAcctGatherType=jobacct_gather/none",
    "JobCompType=jobcomp/none",
)


def render_slurmdbd_conf(layout: Layout, *, user: str, db_password: str, ports: Ports = Ports(),
                         extra_lines: Sequence[str] = ()) -> str:
    lines = [
        "# Written by `lmlaunch cluster up` (launcher/localcluster). Mode 0600: holds the DB password.",
        "AuthType=auth/munge",
        f"DbdHost={controller_hostname()}",
        "DbdAddr=127.0.0.1",
        f"DbdPort={ports.slurmdbd}",
        f"SlurmUser={user}",
        f"PidFile={layout.pidfile('slurmdbd')}",
        f"LogFile={layout.logfile('slurmdbd')}",
        "DebugLevel=info",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={ports.mariadb}",
        "StorageUser=slurm",
        f"StoragePass={db_password}",
        "StorageLoc=slurm_acct_db",
        *extra_lines,
    ]
    return "\n".join(lines) + "\n"
