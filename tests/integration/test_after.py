"""`submit --after` on the real local cluster: a run waits for another and starts when it
succeeded; a run waiting on a failed one is marked as never starting in `status` and `cancel`
cleans it up; an upstream that already failed is refused at submit time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from slurm_helpers import HELD, REPO, wait_reason, wait_terminal

from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs these on the other SLURM version too

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")
SMALL = ("resources.nodes=1", "trainer.max_steps=4", "optim.warmup_steps=1", "trainer.limit_val_batches=0",
         "trainer.val_check_interval=null", "checkpoint.every_n_steps=100", "preemption.max_crash_retries=0")


def _submit(cli, own_jobs, name: str, *extra: str) -> str:
    r = cli("submit", SPEC, f"name={name}", *SMALL, *extra)
    assert r.code == 0, r.out + r.err
    job = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job)
    return job


def _status(cli, name: str) -> dict:
    r = cli("status", name, "--json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)["runs"]
    return next(x for x in rows if x["name"] == name)


def test_a_run_after_another_starts_when_it_succeeded_and_never_after_a_failure(slurm_cluster, cli, lm_env, run_name,
                                                                                 own_jobs, tmp_path):
    # Both upstreams are held until their dependents are queued and seen waiting: neither can end
    # first (under load the 4-step run had COMPLETED before its dependent was submitted, which then
    # rightly ran at once; a failed upstream makes `--after` refuse the dependent).
    good = _submit(cli, own_jobs, f"{run_name}-a", HELD)
    store = tmp_path / "store"  # the data, there when submitted (validate checks it), gone when it starts
    store.symlink_to(REPO / "data" / "prepared" / "tiny")
    bad = _submit(cli, own_jobs, f"{run_name}-b", HELD, f"data.path={store}")
    store.unlink()  # so it crashes at its start
    after_good = _submit(cli, own_jobs, f"{run_name}-c", "--after", f"{run_name}-a")
    after_bad = _submit(cli, own_jobs, f"{run_name}-d", "--after", f"{run_name}-b:ok")
    wait_reason(after_good, "Dependency")
    wait_reason(after_bad, "Dependency")
    slurm.hold(good, release=True)
    slurm.hold(bad, release=True)

    assert wait_terminal(bad) == "FAILED"
    wait_reason(after_bad, "DependencyNeverSatisfied")
    row = _status(cli, f"{run_name}-d")
    assert row["reason"] == "DependencyNeverSatisfied" and "never starts" in row["note"], row
    assert f"{run_name}-b:ok (job {bad})" in row["note"]
    r = cli("cancel", f"{run_name}-d")
    assert r.code == 0, r.err
    assert wait_terminal(after_bad) == "CANCELLED"

    assert wait_terminal(good) == "COMPLETED"
    assert wait_terminal(after_good) == "COMPLETED"
    start_c = slurm.show_job(after_good) or {}
    end_a = slurm.show_job(good) or {}
    if start_c.get("StartTime") and end_a.get("EndTime"):
        assert slurm.parse_time(start_c["StartTime"]) >= slurm.parse_time(end_a["EndTime"])

    # an upstream that already failed: refused before anything is submitted or written
    r = cli("submit", SPEC, f"name={run_name}-e", *SMALL, "--after", f"{run_name}-b")
    assert r.code == 2 and "can never complete successfully" in r.err, r.out + r.err
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / f"{run_name}-e").exists()
