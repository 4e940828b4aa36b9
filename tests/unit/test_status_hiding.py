"""Plain `status` skips, unread, the runs submitted more than a day ago whose last job has ended:
known final in accounting's cache, or no longer pending or running for the controller, whatever
accounting holds (launcher.monitor.slurm_view.ended_jobs, launcher.runs.registry.recent_or_unfinished)."""

from __future__ import annotations

from monitor_synth import T0, make_run

from launcher.monitor.slurm_view import EndedJobs
from launcher.runs import registry as runs

DAY = 86400.0


def test_old_runs_whose_jobs_the_controller_no_longer_lists_are_skipped_whatever_accounting_holds(tmp_path):
    env = {"LMLAUNCH_HOME": str(tmp_path)}
    make_run(tmp_path, "old-ended", job_ids=("7001",), submitted_at=T0 - 5 * DAY)   # neither queued nor in the cache
    make_run(tmp_path, "old-final", job_ids=("7002",), submitted_at=T0 - 5 * DAY)   # accounting's cache: final
    make_run(tmp_path, "old-queued", job_ids=("7003",), submitted_at=T0 - 5 * DAY)  # requeued, pending again
    make_run(tmp_path, "new-ended", job_ids=("7004",), submitted_at=T0 - 60)        # recent: always shown

    def shown(ended: EndedJobs) -> tuple[list[str], int]:
        records, hidden = runs.recent_or_unfinished(ended, T0, environ=env)
        return sorted(r.name for r in records), hidden

    assert shown(EndedJobs({"7002"}, {"7003"})) == (["new-ended", "old-queued"], 2)
    # SLURM unreachable: only what accounting said is known to have ended
    assert shown(EndedJobs({"7002"}, None)) == (["new-ended", "old-ended", "old-queued"], 1)
    assert "7001" in EndedJobs(set(), {"7003"}) and "7003" not in EndedJobs(set(), {"7003"})
