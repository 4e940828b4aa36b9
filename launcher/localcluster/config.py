"""Where the local cluster keeps its state, and its slurm.conf / slurmdbd.conf (pure rendering)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

CLUSTER_NAME = "lmlaunch"
NODES = ("n1", "n2")
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


@dataclass(frozen=True)
class Ports:
    slurmctld: int = 6817
    slurmdbd: int = 6819
    mariadb: int = 3316  # not 3306: a system MariaDB may own that
    nodes: tuple[int, ...] = (6821, 6822)

    @classmethod
    def for_slot(cls, slot: int) -> Ports:
        """The primary cluster's ports (slot 0) shifted for worker cluster ``slot``."""
        base, k = cls(), slot * PORT_STRIDE
        return cls(base.slurmctld + k, base.slurmdbd + k, base.mariadb + k, tuple(p + k for p in base.nodes))

    def to_json(self) -> dict[str, object]:
        return {"slurmctld": self.slurmctld, "slurmdbd": self.slurmdbd, "mariadb": self.mariadb, "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Ports:
        nodes = d["nodes"]
        if not isinstance(nodes, list):
            raise TypeError(f"ports.nodes must be a list of ports, not {nodes!r}")
        return cls(int(str(d["slurmctld"])), int(str(d["slurmdbd"])), int(str(d["mariadb"])), tuple(int(n) for n in nodes))


def primary_root() -> Path:
    """The machine's primary local cluster (the one /etc/slurm/slurm.conf names)."""
    if os.geteuid() == 0:
        return Path("/var/lib/lmlaunch-cluster")
    return Path.home() / ".lmlaunch" / "cluster"


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
    def worker(cls, slot: int) -> Layout:
        """Worker cluster ``slot`` (1..MAX_WORKER_SLOTS), whatever LMLAUNCH_CLUSTER_DIR says."""
        return cls(primary_root() / "workers" / f"w{slot}")

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


def render_slurm_conf(layout: Layout, *, user: str, preempt_send_user_signal: bool, ports: Ports = Ports()) -> str:
    host = controller_hostname()
    r = layout.root
    lines = [
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
        # one machine, no cgroups inside containers: track processes by parent pid
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
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
        "MinJobAge=300",
        "KillWait=10",
        "InactiveLimit=0",
        "SlurmctldTimeout=60",
        "SlurmdTimeout=60",
        "MessageTimeout=20",
        # real accounting (slurmdbd on MariaDB): sacct states, attempts with sacct -D
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={ports.slurmdbd}",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
    ]
    if preempt_send_user_signal:
        lines.append("SlurmctldParameters=preempt_send_user_signal")
    for name, port in zip(NODES, ports.nodes):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE} RealMemory={REAL_MEMORY_MB} State=UNKNOWN"
        )
    nodes = ",".join(NODES)
    lines.append(
        f"PartitionName=low Nodes={nodes} Default=YES MaxTime={MAX_TIME} State=UP "
        f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={LOW_GRACE_SECONDS}"
    )
    lines.append(f"PartitionName=high Nodes={nodes} Default=NO MaxTime={MAX_TIME} State=UP PriorityTier=10 PreemptMode=OFF")
    return "\n".join(lines) + "\n"


def render_slurmdbd_conf(layout: Layout, *, user: str, db_password: str, ports: Ports = Ports()) -> str:
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
    ]
    return "\n".join(lines) + "\n"
