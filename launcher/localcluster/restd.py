"""What a local cluster of a newer SLURM runs beside its controller: slurmrestd with JWT auth,
the expedited requeue and the controller's own OpenMetrics endpoints, where its SLURM has them
(26.05 here, from a Debian sid root; each found by what the installed SLURM offers).

- slurmrestd listens on 127.0.0.1 at the controller's port + 3 (6820 for the native ports, as
  SLURM's own default), with ``-a rest_auth/jwt``: each request carries X-SLURM-USER-NAME and
  X-SLURM-USER-TOKEN (slurmrestd(8)). It runs as nobody (it refuses to run as root or SlurmUser).
- The key that signs and checks the tokens is ``etc/jwt_hs256.key`` (32 random bytes, mode 0600),
  named by AuthAltTypes=auth/jwt / AuthAltParameters=jwt_key= in slurm.conf and slurmdbd.conf;
  its presence marks a cluster that runs slurmrestd.
- ``SlurmctldParameters=enable_expedited_requeue`` lets ``sbatch --requeue=expedite`` jobs be
  eligible at once after a requeue, at the top of the queue (slurm.conf(5), sbatch(1));
  ``MetricsType=metrics/openmetrics`` makes slurmctld answer ``GET /metrics/{jobs,nodes,
  partitions,scheduler}`` on its own port (slurm.conf(5) MetricsType).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from launcher.localcluster.config import Layout, native_version
from launcher.localcluster.daemons import ClusterError, port_open, running_from_pidfile, spawn, wait_until
from lmcore.slurm import versions

Say = Callable[[str], None]
NOBODY = "65534"  # by number: a Debian root's /etc/passwd is the machine's (debian_root._same_names)
REST_PACKAGES = ("slurmrestd", "slurm-wlm-jwt-plugin")


def offers_expedite() -> bool:
    """This SLURM's sbatch takes --requeue[=expedite] (sbatch --help says so; 26.05 does, 24.11 not).
    Asked with a configuration of its own: sbatch reads SLURM_CONF even for --help, and the
    cluster's may not be written yet (it then retried for 60 s and failed: seen on a first `up`)."""
    import subprocess
    import tempfile

    sbatch = shutil.which("sbatch", path=os.environ.get("PATH", "") + ":/usr/bin")
    if sbatch is None:
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as conf:
        conf.write("ClusterName=probe\nSlurmctldHost=localhost\n")
        conf.flush()
        try:
            out = subprocess.run([sbatch, "--help"], capture_output=True, text=True, timeout=30,
                                 env={**os.environ, "SLURM_CONF": conf.name}).stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
    return "--requeue[=expedite]" in out


def offers_metrics() -> bool:
    """slurmctld can serve its own metrics (the metrics/openmetrics plugin is installed)."""
    return any(Path(d, "metrics_openmetrics.so").exists() for d in _plugin_dirs())


def rest_available(version: str | None = None) -> bool:
    """slurmrestd and the JWT plugin are installed here, in a release the REST client speaks."""
    return (_speaks_rest(version or native_version()) and _slurmrestd() is not None
            and any(Path(d, "auth_jwt.so").exists() for d in _plugin_dirs()))


def wants_rest_packages() -> bool:
    """This machine's SLURM speaks a REST API lmlaunch speaks, and slurmrestd or its JWT plugin is missing."""
    return _speaks_rest(native_version()) and not rest_available()


def _speaks_rest(version: str | None) -> bool:
    """Its slurmrestd serves a REST API version the client speaks (the release table says)."""
    known = versions.facts(version)
    return known is not None and bool(known.rest_apis)


def _slurmrestd() -> str | None:
    return shutil.which("slurmrestd", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _plugin_dirs() -> list[str]:
    return ["/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib/slurm"]


def jwt_key(layout: Layout) -> Path:
    return layout.etc / "jwt_hs256.key"


def runs_rest(layout: Layout) -> bool:
    """This cluster was set up with slurmrestd (its key is there)."""
    return jwt_key(layout).exists()


def ensure_key(layout: Layout) -> Path:
    key = jwt_key(layout)
    if not key.exists():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    key.chmod(0o600)
    return key


def auth_lines(layout: Layout) -> list[str]:
    """slurm.conf's and slurmdbd.conf's lines that accept JWTs signed with the cluster's key."""
    return ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={jwt_key(layout)}"]


def controller_lines() -> list[str]:
    """slurm.conf's lines for the expedited requeue (with SlurmctldParameters' other words) and
    the controller's metrics; empty where the SLURM has neither."""
    return ["MetricsType=metrics/openmetrics"] if offers_metrics() else []


def ctld_parameters() -> list[str]:
    return ["enable_expedited_requeue"] if offers_expedite() else []


def url(slurmctld_port: int) -> str:
    return f"http://127.0.0.1:{slurmctld_port + 3}"


def ensure_slurmrestd(layout: Layout, slurmctld_port: int, say: Say) -> None:
    """slurmrestd of this cluster, started when it does not run (it reads slurm.conf at start; a
    change of its auth stops the daemons first: cluster._write_slurm_conf)."""
    port = slurmctld_port + 3
    pidfile = layout.pidfile("slurmrestd")
    if running_from_pidfile(pidfile) and port_open(port):
        return
    say(f"starting slurmrestd on 127.0.0.1:{port} (JWT auth)")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(layout.slurm_conf), "SLURM_JWT": "daemon"}
    proc = spawn([_slurmrestd() or "slurmrestd", "-f", str(layout.slurm_conf), "-a", "rest_auth/jwt",
                  "-u", NOBODY, "-g", NOBODY, f"127.0.0.1:{port}"], env=env, log=layout.logfile("slurmrestd"))
    pidfile.write_text(f"{proc.pid}\n")
    wait_until(lambda: port_open(port) or proc.poll() is not None, 30, "slurmrestd", layout.logfile("slurmrestd"))
    if proc.poll() is not None:
        tail = layout.logfile("slurmrestd").read_text(errors="replace").splitlines()[-5:]
        raise ClusterError(f"slurmrestd exited ({proc.returncode}): " + " | ".join(tail))
