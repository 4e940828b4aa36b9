"""The local cluster's second SLURM version (launcher/localcluster/debian_root.py, config.py):
which release this machine is, what the Debian root sees of it, the client wrappers that enter
the root, and a slurm.conf without accounting. (That the cluster runs is shown on the real one:
tests/integration, LMLAUNCH_TEST_SLURM=24.11.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.localcluster import config, debian_root
from launcher.localcluster.config import Layout, Ports, render_slurm_conf
from lmcore.errors import ExitCode, UserError


def test_the_release_comes_from_os_release(tmp_path, monkeypatch):
    f = tmp_path / "os-release"
    f.write_text('PRETTY_NAME="Debian GNU/Linux 13 (trixie)"\nVERSION_CODENAME=trixie\nID=debian\n')
    assert config.debian_release(f) == "trixie"
    f.write_text('PRETTY_NAME="Debian GNU/Linux forky/sid"\nVERSION_CODENAME=forky\nID=debian\n')
    assert config.debian_release(f) == "sid"  # unstable names the next release's codename
    f.write_text('ID=ubuntu\n')
    assert config.debian_release(f) is None
    assert config.debian_release(tmp_path / "missing") is None
    monkeypatch.setattr(config, "debian_release", lambda: "trixie")
    assert config.native_version() == "24.11" and config.is_native("24.11") and not config.is_native("22.05")
    monkeypatch.setattr(config, "debian_release", lambda: "bookworm")
    assert config.native_version() == "22.05" and config.is_native(None)


def test_the_root_sees_the_checkout_the_python_and_the_state_once_each(tmp_path):
    extra = tmp_path / "data"
    extra.mkdir()
    paths = debian_root.shared_paths(extra=f"{extra}:{extra / 'sub'}:/")
    repo = Path(debian_root.__file__).resolve().parents[2]
    assert any(repo.is_relative_to(p) for p in paths)
    assert any(extra.is_relative_to(p) for p in paths)
    assert Path("/") not in paths and not any(p.is_relative_to(debian_root.ROOTS) for p in paths)
    for a in paths:  # nothing mounted twice: no path under another
        assert not any(a != b and a.is_relative_to(b) for b in paths), paths


def test_a_wrapper_enters_the_root_in_the_callers_directory_or_runs_the_roots_own(tmp_path):
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    debian_root.write_wrappers(root, tmp_path / "bin")
    text = (tmp_path / "bin" / "sbatch").read_text()
    assert f"exec chroot {root} /usr/bin/env --chdir=\"$dir\" /usr/bin/sbatch \"$@\"" in text
    assert f"if [ -e /{debian_root.MARKER} ]; then exec /usr/bin/sbatch" in text
    assert {p.name for p in (tmp_path / "bin").iterdir()} == set(debian_root.CLIENT_COMMANDS)
    # the wrapper is valid sh, and rewriting it with the same text leaves the file alone
    assert subprocess.run(["sh", "-n", str(tmp_path / "bin" / "squeue")]).returncode == 0
    before = (tmp_path / "bin" / "squeue").stat().st_mtime_ns
    debian_root.write_wrappers(root, tmp_path / "bin")
    assert (tmp_path / "bin" / "squeue").stat().st_mtime_ns == before


def test_inside_runs_a_command_in_the_root_in_a_directory():
    assert debian_root.inside(Path("/r"), ["python", "-V"], "/work") == [
        "chroot", "/r", "/usr/bin/env", "--chdir=/work", "python", "-V"]


def test_a_cluster_without_accounting_names_no_slurmdbd_and_keeps_finished_jobs_briefly(tmp_path):
    layout = Layout(tmp_path)
    with_acct = render_slurm_conf(layout, user="root", preempt_send_user_signal=False, ports=Ports.for_slot(2))
    assert "AccountingStorageType=accounting_storage/slurmdbd" in with_acct
    assert f"AccountingStoragePort={Ports.for_slot(2).slurmdbd}" in with_acct and "MinJobAge=300" in with_acct
    without = render_slurm_conf(layout, user="root", preempt_send_user_signal=False, accounting=False, min_job_age=2)
    assert "AccountingStorageType=accounting_storage/none" in without
    assert "AccountingStoragePort" not in without and "MinJobAge=2\n" in without


def test_the_roots_own_system_is_never_shared(monkeypatch):
    """A venv made from /usr/bin/python3 has sys.base_prefix /usr: mounting that into the root hid
    the root's SLURM behind the machine's (its 24.11 cluster ran the machine's 22.05 daemons)."""
    for p in ("/", "/usr", "/usr/lib/python3", "/etc", "/var", "/var/lib", "/lib64", "/run/user", "/dev"):
        assert debian_root.system_path(Path(p)), p
    for p in ("/usr/local", "/usr/local/lib/python3.11", "/root/.pyenv/versions/3.11.7",
              "/var/lib/lmlaunch-cluster", "/tmp", "/check/main", "/opt/py"):
        assert not debian_root.system_path(Path(p)), p
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    paths = debian_root.shared_paths(extra="/usr/lib:/etc:/var")
    assert paths and not any(debian_root.system_path(p) for p in paths), paths
    with pytest.raises(UserError) as err:
        debian_root.ensure_root("24.11", print)  # said before anything is made or mounted
    assert err.value.exit_code == ExitCode.UNAVAILABLE
    assert "Python outside /usr" in str(err.value) and "LMLAUNCH_PYTHON" in str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_mounts_in_the_root_that_are_not_shared_paths_are_taken_away(tmp_path, monkeypatch):
    """What an earlier lmlaunch left mounted in the root (the machine's /usr, a deleted /check) is
    unmounted before the shared paths are mounted; a half-made root is deleted only once nothing
    of the machine is mounted in it."""
    root, shared, gone = tmp_path / "root", tmp_path / "shared", tmp_path / "gone"
    for d in (root / "stale", shared, gone):
        d.mkdir(parents=True)
    (shared / "keep").write_text("the machine's file")
    monkeypatch.setattr(debian_root, "shared_paths", lambda: [shared])
    subprocess.run(["mount", "--bind", str(gone), str(root / "stale")], check=True)
    try:
        debian_root.ensure_mounts(root)
        points = {m for m in debian_root._mounted() if m.startswith(f"{root}/")}
        assert f"{root}/stale" not in points
        assert {f"{root}/proc", f"{root}/sys", f"{root}/dev", f"{root}{shared}"} <= points, points
        debian_root.ensure_mounts(root)  # idempotent
        debian_root._remove_root(root)
        assert not root.exists() and (shared / "keep").read_text() == "the machine's file"
    finally:
        debian_root.unmount(root)


def test_a_root_without_etc_hosts_gets_the_machines_names_once(tmp_path):
    """debootstrap's minbase trixie root has no /etc/hosts (netbase ships it): `cluster up --slurm
    24.11` on a fresh Debian 12 machine failed there with FileNotFoundError."""
    from launcher.localcluster.debian_root import _same_names

    (tmp_path / "etc").mkdir()
    _same_names(tmp_path)
    machine = [line for line in Path("/etc/hosts").read_text().splitlines()
               if line.strip() and not line.lstrip().startswith("#")]
    assert (tmp_path / "etc/hosts").read_text().splitlines() == machine
    _same_names(tmp_path)  # again: nothing added twice
    assert (tmp_path / "etc/hosts").read_text().splitlines() == machine
