"""What the two SLURM versions of the local cluster (22.05 and 24.11) answer differently, and that
lmcore.slurm.client reads both alike. The outputs are the ones captured from each version's
commands on this machine; a stand-in command on PATH replays them."""

from __future__ import annotations

import pytest

from lmcore.errors import UserError
from lmcore.slurm import client as slurm

# `sacctmgr -i add account lmlaunch ...` when the account exists
ADD_EXISTING = {
    "22.05": (0, " Nothing new added.\n"),
    "24.11": (1, " Already existing account lmlaunch on cluster lmlaunch\n"),
}


def _replay(tmp_path, monkeypatch, name: str, code: int, out: str, *, stderr: bool = False) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / f"{name}.out").write_text(out)
    script = bindir / name
    script.write_text(f"#!/bin/sh\ncat {tmp_path / (name + '.out')}{' >&2' if stderr else ''}\nexit {code}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")


@pytest.mark.parametrize("version", sorted(ADD_EXISTING))
def test_adding_an_account_that_exists_is_no_error_on_either_version(tmp_path, monkeypatch, version):
    code, out = ADD_EXISTING[version]
    _replay(tmp_path, monkeypatch, "sacctmgr", code, out)
    assert slurm.sacctmgr(["add", "account", "lmlaunch", "cluster=lmlaunch"]) == out.strip()


def test_a_real_sacctmgr_failure_is_still_an_error(tmp_path, monkeypatch):
    _replay(tmp_path, monkeypatch, "sacctmgr", 1, " Unknown option: colour=blue\n")
    with pytest.raises(UserError, match="Unknown option"):
        slurm.sacctmgr(["add", "account", "x", "colour=blue"])


def test_a_cluster_without_accounting_is_told_apart_from_a_slurmdbd_that_is_down(tmp_path, monkeypatch):
    """`sacct` on a cluster with AccountingStorageType=accounting_storage/none (both versions say
    the same) can never answer: status and history say what is not known, not how to start slurmdbd."""
    _replay(tmp_path, monkeypatch, "sacct", 1, "Slurm accounting storage is disabled\n", stderr=True)
    with pytest.raises(slurm.NoAccounting, match="keeps no job accounting"):
        slurm.sacct(["7"])
    _replay(tmp_path, monkeypatch, "sacct", 1, "sacct: error: slurmdbd: Connection refused\n", stderr=True)
    with pytest.raises(slurm.SlurmUnavailable) as down:
        slurm.sacct(["7"])
    assert not isinstance(down.value, slurm.NoAccounting) and "cluster up" in down.value.message


def test_the_user_is_the_one_slurm_knows_whatever_USER_says(monkeypatch):
    """SLURM maps the uid: $USER unset (as in this machine's shells: doctor then asked sacctmgr
    about "user 0" and failed a good account) or naming someone else changes nothing."""
    import os
    import pwd

    own = pwd.getpwuid(os.getuid()).pw_name
    monkeypatch.delenv("USER", raising=False)
    monkeypatch.delenv("LOGNAME", raising=False)
    assert slurm.user_name() == own
    monkeypatch.setenv("USER", "someone-else")
    assert slurm.user_name() == own
