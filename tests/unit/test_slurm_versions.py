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


def test_what_differs_by_release_is_read_from_the_release_table():
    """Adding a release is one entry in lmcore.slurm.versions: the local cluster's releases, the REST
    client's API versions, sacctmgr's words and the job states all come from it."""
    from pathlib import Path

    from launcher.localcluster.config import SLURM_RELEASES
    from lmcore.slurm import records, rest, versions

    assert SLURM_RELEASES == {r.name: r.debian for r in versions.RELEASES}
    assert versions.TESTED == ("22.05", "24.11", "26.05")
    assert rest.KNOWN_APIS == ("v0.0.45", "v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40")
    assert all(records.STATE_GROUPS[s] == g for r in versions.RELEASES for s, g in r.job_states.items())
    assert records.state_group("EXPEDITING") == "queued"
    for version, (_code, out) in ADD_EXISTING.items():  # each release's own words are in its entry
        assert any(w in out for w in versions.facts(version).sacctmgr_exists), version
    assert versions.facts("24.11.5").name == "24.11" and versions.facts("25.05.1") is None
    assert versions.with_topology("block") == ("24.11", "26.05")
    repo = Path(__file__).resolve().parents[2]
    for r in versions.RELEASES:  # every behaviour handled for a release names a module that exists
        for q in r.quirks:
            parts = q.where.split(".")
            assert any((repo / root / Path(*parts)).with_suffix(".py").is_file() for root in ("", "src")), q


def test_the_architecture_page_shows_the_release_table_as_it_is():
    from pathlib import Path

    from lmcore.slurm import versions

    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    assert versions.markdown_table() in page, (
        "docs/architecture.md's release table is stale: run `python -m lmcore.slurm.versions --write docs/architecture.md`")
