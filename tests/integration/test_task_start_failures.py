"""A task step that fails before lmtrain's entry starts is a FAILED job, whatever runs it: in a
podman container whose image lacks the interpreter asked for (runc: exit 127) the batch script's
teardown (the SLURM relay stopped after srun) used to end the job 0:0, COMPLETED in `status`
with no attempt anywhere. Now the job, its batch step and the task step are FAILED 127 in
accounting, `status` says FAILED, and `logs --errors` shows the runtime's own error line; the
same interpreter missing on the host is FAILED too. `submit` tries the interpreter in the image
first and refuses (nothing written) unless --force."""

from __future__ import annotations

import json

import pytest
import waiting
from slurm_helpers import REPO

from lmcore.slurm import client as slurm

PODMAN_IMAGE = "localhost/lmlaunch/task:latest"  # scripts/test.sh builds it (lmlaunch cluster image)
SMALL = ["resources.nodes=1", "trainer.max_steps=5", "optim.warmup_steps=1", "trainer.val_check_interval=5"]


@pytest.mark.parametrize("where, overrides, error", [
    ("podman", ["container.runtime=podman", f"container.image={PODMAN_IMAGE}", "container.python=python3"],
     'exec: "python3": executable file not found'),
    ("host", ["--cluster", "local"], "srun: error"),
])
def test_a_task_that_cannot_start_its_interpreter_fails_the_job(slurm_cluster, cli, lm_env, run_name, own_jobs,
                                                                tmp_path, where, overrides, error):
    spec = REPO / "jobs" / "tiny-cpu.yaml"
    if where == "host":
        prof = tmp_path / "profiles"
        prof.mkdir()  # the local cluster with an interpreter its nodes do not have
        text = (REPO / "cluster_profiles" / "local.yaml").read_text().replace("python: auto", "python: /nonexistent/python3")
        (prof / "nopython.yaml").write_text(text)
        lm_env = {**lm_env, "LMLAUNCH_PROFILES_DIR": str(prof)}
        overrides = ["--cluster", "nopython"]
    if where == "podman":  # tried before queueing: refused, nothing written; --force submits it anyway
        r = cli("submit", str(spec), f"name={run_name}", *SMALL, *overrides, env=lm_env)
        assert r.code == 4 and "container.python: `python3` does not start in" in r.err and error in r.err, r.err
        assert "--force submits anyway" in r.err and not (tmp_path / "runs" / run_name).exists()  # lm_env's root
        listed = json.loads(cli("status", "--all", "--json", env=lm_env).out)["runs"]
        assert not [x for x in listed if x["name"] == run_name], listed
        overrides = [*overrides, "--force"]
    r = cli("submit", str(spec), f"name={run_name}", *SMALL, *overrides, env=lm_env)
    assert r.code == 0, r.out + r.err
    job = r.out.split("job ", 1)[1].split()[0]
    own_jobs.append(job)
    waiting.until(lambda: not any(slurm.is_active(j.state) for j in slurm.squeue([job])), poll=1.0,
                  progress=waiting.job(job), what=f"job {job} ended")
    # the job, its batch step and the task step: FAILED with the interpreter's exit status (127), in accounting
    # (slurmdbd may record the batch step's end a moment after squeue forgot the job: wait for it)
    def accounted() -> dict | None:
        got = {a.job_id: (a.state, a.exit_code) for a in slurm.sacct([job], steps=True)}
        return got if got and not any(slurm.is_active(state) for state, _ in got.values()) else None

    rows = waiting.until(accounted, poll=1.0, what=f"job {job}'s steps in accounting",
                         progress=lambda: tuple(sorted((a.job_id, a.state) for a in slurm.sacct([job], steps=True))))
    assert rows[job][0] == "FAILED" and rows[job][1].split(":")[0] != "0", rows
    assert rows[f"{job}.batch"][0] == "FAILED" and rows[f"{job}.0"][0] == "FAILED", rows
    row = next(x for x in json.loads(cli("status", run_name, "--json", env=lm_env).out)["runs"] if x["name"] == run_name)
    assert row["state"] == "FAILED" and row["group"] == "failed", row
    assert row["note"].startswith(f"job {job} ended before any attempt started"), row  # and where to look
    assert f"lmlaunch logs {run_name} --errors" in row["note"], row
    logs = cli("logs", run_name, "--errors", env=lm_env)
    assert error in logs.out, logs.out + logs.err
    notes = json.loads(cli("history", run_name, "--json", env=lm_env).out)["notes"]
    assert any(n.startswith(f"job {job} ended before any attempt started") and error in n for n in notes), notes
