"""A user cancel, through `lmlaunch cancel` (CANCELLED marker, then
scancel) or a bare `scancel`, is never requeued and the ledger says `cancelled`.

Both runs train at the same time (each holds one CPU of each node) to keep the test short.
"""

from __future__ import annotations

import time

import pytest
import waiting
from preempt_helpers import ends, lm, log_tail, starts, submit, wait_step
from slurm_helpers import wait_accounted

from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs these on the other SLURM version too


def _wait_ended_without_requeue(job_id: str) -> str:
    """Wait for the job to end, while it advances; fail at once if SLURM (or the runtime) requeued it."""
    def ended() -> str | None:
        info = slurm.show_job(job_id) or {}
        assert info.get("Restarts", "0") == "0", f"job {job_id} was requeued after a cancel: {info}"
        state = slurm.job_state(job_id)
        return state if slurm.state_group(state) not in ("queued", "running") else None

    return waiting.until(ended, progress=waiting.job(job_id), what=f"job {job_id} ended after the cancel")


def test_lmlaunch_cancel_and_bare_scancel_end_cancelled_and_are_never_requeued(slurm_cluster, lm_env, run_name, own_jobs):
    via_cli, bare = f"{run_name}-cli", f"{run_name}-bare"
    job_cli, dir_cli = submit(lm_env, via_cli)
    job_bare, dir_bare = submit(lm_env, bare)
    own_jobs += [job_cli, job_bare]
    wait_step(dir_cli, 5, attempt=1)
    wait_step(dir_bare, 5, attempt=1)

    code, out, err = lm(lm_env, "cancel", via_cli)
    assert code == 0, out + err
    slurm.cancel([job_bare])  # no marker: the runtime must learn it from SLURM's job state

    for job, run_dir in ((job_cli, dir_cli), (job_bare, dir_bare)):
        state = _wait_ended_without_requeue(job)
        assert slurm.state_group(state) == "cancelled", f"job {job} ended {state}\n{log_tail(run_dir)}"
        assert wait_accounted(job).group == "cancelled"
        # give a requeue that would come late the chance to show itself
        time.sleep(2)
        assert slurm.restart_count(job) == 0
        assert len(starts(run_dir)) == 1, starts(run_dir)
        end = ends(run_dir)
        assert len(end) == 1 and end[0]["reason"] == "cancelled" and end[0]["requeued"] is False, (
            f"{run_dir.name}: {end}\n{log_tail(run_dir)}"
        )
        assert not (run_dir / "DONE").exists()
    assert (dir_cli / "CANCELLED").exists() and not (dir_bare / "CANCELLED").exists()
