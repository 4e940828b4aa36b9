"""A real OpenSSH login node on this machine for the remote tests: Debian's sshd on a loopback port
of its own (key login only), and a cluster account whose home holds the remote side's runs.

The cluster account is a second login name of uid 0 with a home of its own
(/var/tmp/lmlaunch-cluster-account): the interpreter of the test venv lives under /root (mode 700
on this machine kind), which another uid cannot reach, while a login of its own with its own
home is what the tests need (the runs, registry and staging land there, none under the
workstation user's). The workstation side is this test process (HOME /root), with its own ssh
config file named in the profile's ``login.options``. The worker's SLURM cluster and the test's
runs root reach the login shell as ssh SetEnv variables the sshd accepts (a login node's own
environment would name them).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import waiting

ACCOUNT = "lmcluster"
ACCOUNT_HOME = Path("/var/tmp/lmlaunch-cluster-account")
SSHD = Path("/usr/sbin/sshd")
PASSED_ENV = ("SLURM_CONF", "LMLAUNCH_CLUSTER_DIR", "LMLAUNCH_RUNS_ROOT", "LMLAUNCH_HOME", "LMLAUNCH_FAULTS")


@dataclass
class LoginNode:
    port: int
    key: Path
    config: Path
    proc: subprocess.Popen

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)  # then killed: not a verdict
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_account() -> None:
    if subprocess.run(["getent", "passwd", ACCOUNT], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-o", "-u", "0", "-g", "0", "-M", "-d", str(ACCOUNT_HOME), "-s", "/bin/bash",
                        ACCOUNT], check=True)
    subprocess.run(["usermod", "-p", "*", ACCOUNT], check=True)  # unlocked for key login (no password; no PAM)
    ACCOUNT_HOME.mkdir(mode=0o700, parents=True, exist_ok=True)


def start(where: Path) -> LoginNode:
    """sshd on 127.0.0.1:<free port>, host and client keys in ``where``, the client key
    authorised for the cluster account; an ssh config naming the host ``cluster-login``."""
    if not SSHD.exists():
        raise RuntimeError("openssh-server is not installed (scripts/setup.sh installs it)")
    ensure_account()
    where.mkdir(parents=True, exist_ok=True)
    host_key, key = where / "host_ed25519", where / "client_ed25519"
    for k in (host_key, key):
        if not k.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
    ssh_dir = ACCOUNT_HOME / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    auth = ssh_dir / "authorized_keys"
    pub = (key.with_suffix(".pub")).read_text()
    if pub not in (auth.read_text() if auth.exists() else ""):
        with open(auth, "a") as f:
            f.write(pub)
    os.chmod(auth, 0o600)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    port = _free_port()
    proc = subprocess.Popen(
        [str(SSHD), "-D", "-e", "-f", "/dev/null", "-o", f"Port={port}", "-o", "ListenAddress=127.0.0.1",
         "-o", f"HostKey={host_key}", "-o", f"PidFile={where / 'sshd.pid'}", "-o", "UsePAM=no",
         "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no",
         "-o", "PermitRootLogin=prohibit-password", "-o", "AuthorizedKeysFile=.ssh/authorized_keys",
         "-o", f"AcceptEnv={' '.join(PASSED_ENV)}", "-o", "MaxSessions=50", "-o", "MaxStartups=50"],
        stdout=open(where / "sshd.log", "ab"), stderr=subprocess.STDOUT,
    )
    config = where / "ssh_config"
    config.write_text(
        f"Host cluster-login\n  HostName 127.0.0.1\n  Port {port}\n  User {ACCOUNT}\n  IdentityFile {key}\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited {proc.returncode}: {(where / 'sshd.log').read_text()[-2000:]}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        waiting.until(listening, progress=waiting.process_cpu(proc.pid), poll=0.05, what=f"sshd listening on {port}")
    except waiting.Stalled:
        proc.kill()
        raise
    return LoginNode(port, key, config, proc)


def profile_text(repo: Path, node: LoginNode, control_path: Path, env: dict[str, str], *,
                 require_master: bool = False) -> str:
    """The local cluster's profile with a login section reaching it through ``node``; a spec sent
    from the workstation has its relative paths start from the checkout's jobs/ there (the same
    directory: one machine)."""
    passed = " ".join(f"{k}={env[k]}" for k in PASSED_ENV if env.get(k))
    lmlaunch = Path(sys.executable).parent / "lmlaunch"  # this venv's, on the same machine
    return (repo / "cluster_profiles" / "local.yaml").read_text() + (
        "login:\n"
        "  ssh: cluster-login\n"
        f"  lmlaunch: {lmlaunch}\n"
        f"  control_path: {control_path}\n"
        f"  require_master: {'true' if require_master else 'false'}\n"
        f"  workdir: {repo / 'jobs'}\n"
        f"  options: [-F, {node.config}, -o, 'SetEnv={passed}']\n"
    )


def forwarded(*words: str) -> list[int]:
    """Processes the login node's side runs for a workstation (LMLAUNCH_FORWARDED=1 in their
    environment) whose command line holds ``words`` in order."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        if b"LMLAUNCH_FORWARDED=1" in environ and any(args[i:i + len(words)] == list(words) for i in range(len(args))):
            found.append(int(entry.name))
    return found
