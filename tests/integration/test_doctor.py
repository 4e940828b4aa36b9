"""`lmlaunch doctor` on the real local cluster: a clean spec passes; each injected fault is a
non-zero exit whose report names it (missing data, wrong vocab, a read-only checkpoint
directory, a filesystem without room, a GraceTime shorter than the run's measured checkpoint)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import REPO

from lmcore.run.rundir import LEDGER, AttemptEnd, AttemptStart, Ledger
from lmcore.slurm import admin

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")


def _doctor(cli, *overrides: str) -> tuple[int, dict]:
    r = cli("doctor", SPEC, *overrides, "--json")
    return r.code, json.loads(r.out)


def _by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs (root may mount here), remounted read-only on request."""
    mounted: list[Path] = []

    def make(name: str, *, read_only: bool = False) -> Path:
        d = tmp_path / name
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
        mounted.append(d)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


@pytest.mark.both_versions  # scripts/test.sh runs it on the other SLURM version too
def test_a_clean_spec_on_the_local_cluster_passes(slurm_cluster, cli):
    code, report = _doctor(cli)
    assert code == 0 and report["ok"], report
    checks = _by_name(report)
    for name in ("slurm", "accounting", "partition", "preemption", "grace time", "checkpoint space",
                 "data vocab", "data size", "runtime"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["partition"]["figures"]["partition"] == "low"
    assert checks["grace time"]["figures"]["grace_seconds"] == 30


def test_missing_data_and_wrong_vocab_are_named(slurm_cluster, cli, tmp_path):
    code, report = _doctor(cli, f"data.path={tmp_path / 'nowhere'}")
    assert code == 1 and _by_name(report)["data"]["status"] == "fail"
    assert "no such directory" in _by_name(report)["data"]["message"]
    code, report = _doctor(cli, "model.config.vocab_size=200")
    vocab = _by_name(report)["data vocab"]
    assert code == 1 and vocab["status"] == "fail" and vocab["figures"] == {"data_vocab": 260, "model_vocab": 200}
    admin.set_node_state("n2", "DRAIN", "doctor test")  # a node out of service: the job would wait, not fail
    try:
        _, report = _doctor(cli)
    finally:
        admin.set_node_state("n2", "RESUME")
    script = _by_name(report)["job script"]
    assert script["status"] == "warn" and "out of service: n2 (drain" in script["message"], script


def test_a_read_only_or_small_checkpoint_filesystem_is_named(slurm_cluster, cli, tmpfs):
    ro = tmpfs("ro", read_only=True)
    code, report = _doctor(cli, f"checkpoint.dir={ro}/ckpt")
    space = _by_name(report)["checkpoint space"]
    assert code == 1 and space["status"] == "fail" and "cannot write there" in space["message"], space
    small = tmpfs("small")
    code, report = _doctor(cli, f"checkpoint.dir={small}/ckpt")
    space = _by_name(report)["checkpoint space"]
    assert code == 1 and space["status"] == "fail", space
    assert space["figures"]["free_bytes"] < space["figures"]["needed_bytes"]


def test_a_grace_time_shorter_than_the_runs_measured_checkpoint_is_named(slurm_cluster, cli, lm_env):
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / "tiny-cpu"
    run_dir.mkdir(parents=True)
    ledger = Ledger(run_dir / LEDGER)
    ledger.write(AttemptStart(attempt=1, job_id="9", restart_count=0, time=0.0, start_step=0, nodes=["n1"], world_size=2))
    ledger.write(AttemptEnd(attempt=1, job_id="9", time=60.0, end_step=40, reason="preempted", requeued=True,
                            extra={"checkpoint_seconds": 48.0}))
    code, report = _doctor(cli)
    grace = _by_name(report)["grace time"]
    assert code == 1 and grace["status"] == "fail", grace
    assert grace["figures"] == {"grace_seconds": 30.0, "checkpoint_seconds": 48.0, "measured": True}
    assert "GraceTime 30 s but the checkpoint takes 48 s" in grace["message"]
