"""Shared filesystem: two runs never share a checkpoint directory (refused at submit, before
anything is written or queued)."""

from __future__ import annotations

import re
from pathlib import Path

from slurm_helpers import REPO, wait_for

from launcher.runs import registry as runs
from lmcore.slurm import client as slurm

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")


def test_second_run_with_the_same_checkpoint_dir_is_refused_before_submission(
    slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path
):
    shared = tmp_path / "shared ckpts"
    first = cli("submit", SPEC, f"name={run_name}", f"checkpoint.dir={shared}", "trainer.max_steps=5", "optim.warmup_steps=1")
    assert first.code == 0, first.err
    job_id = re.search(r"job (\d+)", first.out).group(1)
    own_jobs.append(job_id)
    slurm.cancel([job_id])

    other = f"{run_name}-b"
    r = cli("submit", SPEC, f"name={other}", f"checkpoint.dir={shared}/", "trainer.max_steps=5", "optim.warmup_steps=1")
    assert r.code == 2, r.out + r.err
    assert f"already the checkpoint directory of run '{run_name}'" in r.err and str(shared) in r.err
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / other).exists()
    assert runs.load_record(other, lm_env) is None
    assert [j.job_id for j in slurm.squeue(name=other)] == []
    # the same run may resume with its own directory
    wait_for(job_id, {"cancelled", "completed", "failed"}, poll=0.5)
    again = cli("submit", SPEC, f"name={run_name}", f"checkpoint.dir={shared}", "trainer.max_steps=5", "optim.warmup_steps=1", "--resume")
    assert again.code == 0, again.err
    own_jobs.append(re.search(r"job (\d+)", again.out).group(1))
    slurm.cancel(own_jobs[-1:])
