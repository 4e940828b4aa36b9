"""A cluster without accounting (no slurmdbd: `sacct` fails) that forgets finished jobs after
MinJobAge=2 s, as some sites run: submit, a real preemption and requeue, the end, then `status`
and `history` tell the state and why each attempt ended from the run directory, and say what
cannot be known without sacct. The cluster is a worker slot of its own, started so
(`up(accounting=False, min_job_age=2)`); the next session to claim that slot starts it with
accounting again (conftest.py passes both settings)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from slurm_helpers import REPO, SMALL_MODEL, faults, pace, release_worker

from launcher.core import slurm
from launcher.localcluster import cluster, workers

MAX_STEPS = 120


def _status(lm, name) -> dict:
    r = lm("status", "--json", "--all", name)
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_a_run_preempted_and_finished_on_a_cluster_without_accounting_is_told_from_its_run_directory(
    slurm_cluster, cli, lm_env, run_name, tmp_path
):
    own = workers.claim()
    try:
        lines: list[str] = []
        cluster.up(lines.append, layout=own.layout, ports=own.ports, system_conf=False, accounting=False, min_job_age=2)
        env = {**lm_env, **cluster.environ_of(own.layout)}

        def lm(*args: str):
            return cli(*args, env=env)

        with cluster.own_conf(own.layout):
            assert "accounting_storage/none" in slurm.config().get("AccountingStorageType", "")
            with faults(pace()):
                r = lm("submit", str(REPO / "jobs" / "tiny-cpu.yaml"), f"name={run_name}", "resources.nodes=1",
                        f"trainer.max_steps={MAX_STEPS}", "checkpoint.every_n_steps=10", "optim.warmup_steps=3",
                        *SMALL_MODEL)
            assert r.code == 0, r.err
            job = r.out.split("job ", 1)[1].split()[0]
            run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
            deadline = time.monotonic() + 180
            while not any((run_dir / "checkpoints").glob("step-*/COMPLETE")):
                assert time.monotonic() < deadline, "no checkpoint within 180 s"
                time.sleep(1.0)

            r = lm("preempt", run_name, "--mode", "requeue", "--start-now", "--json")
            assert r.code == 0 and json.loads(r.out)["requeued"], r.out + r.err
            deadline = time.monotonic() + 240
            while not (run_dir / "DONE").exists():
                assert time.monotonic() < deadline, "the requeued run did not finish within 240 s"
                time.sleep(1.0)
            deadline = time.monotonic() + 60  # MinJobAge=2: the controller forgets the job at once
            while slurm.squeue([job]):
                assert time.monotonic() < deadline, slurm.squeue([job])
                time.sleep(1.0)

            data = _status(lm, run_name)
            (row,) = data["runs"]
            assert (row["state"], row["step"], row["attempt"]) == ("COMPLETED", MAX_STEPS, 2), row
            assert "keeps no job accounting" in data["slurm"]["message"], data["slurm"]
            r = lm("history", run_name)
            assert r.code == 0, r.err
            assert "preempted" in r.out and "reached max_steps" in r.out, r.out
            assert "queue wait unknown: this cluster keeps no job accounting" in r.out, r.out
            assert "slurmdbd" not in r.out.replace("(sacct: accounting storage is disabled)", "")
    finally:
        release_worker(own, run_name)
