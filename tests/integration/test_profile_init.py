"""`lmlaunch profile init NAME` on the real local cluster, as a new user would: the profile read off
the live cluster (scontrol, sacctmgr) says what the shipped local.yaml says, validates, is found by
`--cluster NAME`, is not overwritten without --force, and a job submitted with it trains to the end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from slurm_helpers import REPO, SMALL_MODEL, wait_terminal

from launcher.spec.profiles import load_profile_file

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs these on the other SLURM version too

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")


def test_a_profile_read_off_the_cluster_matches_the_shipped_one_and_a_job_runs_with_it(cli, lm_env, run_name, own_jobs):
    r = cli("profile", "init", "mine")
    assert r.code == 0, r.out + r.err
    path = Path(lm_env["LMLAUNCH_HOME"]) / "profiles" / "mine.yaml"
    assert f"wrote {path}" in r.out
    mine, shipped = load_profile_file(path), load_profile_file(REPO / "cluster_profiles" / "local.yaml")
    for field in ("partitions", "default_partition", "preemptible_partition", "high_priority_partition", "gpus_per_node",
                  "max_tasks_per_node", "sends_user_signal_on_preemption", "python"):
        got, want = getattr(mine, field), getattr(shipped, field)
        if field == "partitions":  # the same partitions, times and preemption (MaxTime as SLURM prints it)
            got = {k: (v.max_minutes, v.preemptible, v.grace_seconds) for k, v in got.items()}
            want = {k: (v.max_minutes, v.preemptible, v.grace_seconds) for k, v in want.items()}
        assert got == want, (field, got, want)
    assert mine.env["GLOO_SOCKET_IFNAME"].value == "lo"
    assert mine.account == "root"  # root's DefaultAccount in the cluster's accounting

    written = path.read_text()
    assert r.out.startswith(written)  # what it wrote, shown
    again = cli("profile", "init", "mine")
    assert again.code == 2 and "exists: lmlaunch keeps it" in again.err and "--force" in again.err
    assert path.read_text() == written  # untouched
    assert cli("profile", "init", "mine", "--force").code == 0

    sub = cli("submit", SPEC, "--cluster", "mine", f"name={run_name}", "trainer.max_steps=6", "optim.warmup_steps=1",
              "trainer.val_check_interval=null", *SMALL_MODEL)
    assert sub.code == 0, sub.out + sub.err
    job = re.search(r"job (\d+)", sub.out).group(1)
    own_jobs.append(job)
    assert wait_terminal(job) == "COMPLETED"
    status = cli("status", run_name)
    assert "COMPLETED" in status.out and "6/6" in status.out, status.out
