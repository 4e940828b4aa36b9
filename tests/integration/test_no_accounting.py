"""A cluster without accounting (no slurmdbd: `sacct` fails) that forgets finished jobs after
MinJobAge=2 s, as some sites run: a run with a real preemption and requeue, a run stopped at its
time limit, a throttled sweep (one SLURM array) and a cancelled run, all at once; then `status`,
`history` and `logs` tell each one's state and why each attempt ended from the run directory,
and say what cannot be known without sacct. The cluster is a worker slot of its own, started so
(`up(accounting=False, min_job_age=2)`); the next session to claim that slot starts it with
accounting again (conftest.py passes both settings)."""

from __future__ import annotations

import json
from pathlib import Path

import waiting
from slurm_helpers import REPO, SMALL_MODEL, faults, pace, release_worker

from launcher.localcluster import cluster, workers
from lmcore.slurm import client as slurm

MAX_STEPS = 120


def _status(lm, name: str | None = None) -> dict:
    r = lm("status", "--json", "--all", *([name] if name else []))
    assert r.code == 0, r.err
    return json.loads(r.out)


def _history(lm, name: str) -> dict:
    r = lm("history", name, "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def _submit_the_others(lm, name: str, tmp_path: Path) -> dict[str, str]:
    """Beside the preempted run (on n1): a run whose 2-minute time limit ends it (max_timeouts=0, its
    steps slowed so it cannot finish first), a 2-point sweep run one point at a time, a run to
    cancel. They hardly use the CPU (slow steps, few steps, cancelled)."""
    # on n2: the preemption of the first run (an exclusive job on its node, n1) must not reach them
    small = ("resources.nodes=1", "slurm.sbatch.nodelist=n2", "optim.warmup_steps=1", *SMALL_MODEL)
    spec = str(REPO / "jobs" / "tiny-cpu.yaml")
    with faults(pace(0.8)):
        r = lm("submit", spec, f"name={name}-tl", "resources.time=00:02:00", "preemption.warning_seconds=60",
               "preemption.max_timeouts=0", "trainer.max_steps=400", *small)
        assert r.code == 0, r.err
        r = lm("submit", spec, f"name={name}-cx", "trainer.max_steps=100000", *small)
        assert r.code == 0, r.err
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({"name": f"{name}-sw", "max_parallel": 1, "grid": {"optim.lr": [0.001, 0.003]}}))
    r = lm("sweep", spec, str(sweep), "trainer.max_steps=20", "checkpoint.every_n_steps=100", *small, "--json")
    assert r.code == 0, r.err
    arrays = json.loads(r.out)["arrays"]
    assert len(arrays) == 1, arrays
    return {"tl": f"{name}-tl", "sw": f"{name}-sw", "cx": f"{name}-cx"}


def _check_the_others(lm, names: dict[str, str]) -> None:
    r = lm("cancel", names["cx"])
    assert r.code == 0, r.out + r.err
    seen: dict = {}

    def all_ended() -> bool:  # all three end; SLURM forgets each 2 s later (the rows then come from the run directories)
        seen["rows"] = rows = {row["name"]: row for row in _status(lm)["runs"]}
        seen["points"] = points = _status(lm, names["sw"])["runs"]
        forgotten = all("SLURM has no record" in rows[names[k]]["note"] for k in ("tl", "cx"))
        return forgotten and len(points) == 2 and all(p["group"] == "completed" for p in points)

    waiting.until(all_ended, poll=2.0, progress=lambda: json.dumps(seen, sort_keys=True, default=str),
                  what="the other runs ended and forgotten by SLURM", explain=lambda: f"{seen.get('rows')}")
    rows, points = seen["rows"], seen["points"]
    tl, cx = rows[names["tl"]], rows[names["cx"]]
    assert (tl["state"], tl["attempt"]) == ("TIMEOUT", 1) and "ended limit_reached, not requeued" in tl["note"], tl
    assert cx["state"] == "CANCELLED" and "CANCELLED marker" in cx["note"], cx
    assert [p["name"] for p in points] == [f"{names['sw']}.0", f"{names['sw']}.1"], points
    # SLURM may still hold a finished array task's record (the array's other task ended later)
    assert all((p["state"], p["step"]) == ("COMPLETED", 20) for p in points), points
    assert rows[names["sw"]]["state"] == "2 COMPLETED", rows[names["sw"]]
    (a,) = _history(lm, names["tl"])["attempts"]  # JSON: the table's columns shrink to the terminal
    assert a["reason"] == "limit_reached" and "max_timeouts(0) reached" in a["detail"], a
    (a,) = _history(lm, names["cx"])["attempts"]
    assert a["reason"] == "cancelled" and "never requeued" in a["detail"], a
    r = lm("logs", names["tl"])
    assert r.code == 0 and "max_timeouts(0) reached" in r.out, r.out[-2000:]


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
                       "slurm.sbatch.nodelist=n1",
                        f"trainer.max_steps={MAX_STEPS}", "checkpoint.every_n_steps=10", "optim.warmup_steps=3",
                        *SMALL_MODEL)
            assert r.code == 0, r.err
            job = r.out.split("job ", 1)[1].split()[0]
            run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
            others = _submit_the_others(lm, run_name, tmp_path)
            waiting.until(lambda: any((run_dir / "checkpoints").glob("step-*/COMPLETE")), poll=1.0,
                          progress=waiting.watching(waiting.tree(run_dir), waiting.job(job)), what="a complete checkpoint")

            r = lm("preempt", run_name, "--mode", "requeue", "--start-now", "--json")
            assert r.code == 0 and json.loads(r.out)["requeued"], r.out + r.err
            waiting.until((run_dir / "DONE").exists, poll=1.0,
                          progress=waiting.watching(waiting.tree(run_dir), waiting.job(job)), what="the requeued run's DONE")
            # MinJobAge=2: the controller forgets the job at once
            waiting.until(lambda: not slurm.squeue([job]), poll=1.0, progress=waiting.queue([job]),
                          what=f"job {job} forgotten by the controller")

            data = _status(lm, run_name)
            (row,) = data["runs"]
            assert (row["state"], row["step"], row["attempt"]) == ("COMPLETED", MAX_STEPS, 2), row
            assert "keeps no job accounting" in data["slurm"]["message"], data["slurm"]
            r = lm("history", run_name)
            assert r.code == 0, r.err
            text = " ".join(r.out.split())  # lines wrap at the terminal's width
            assert "preempted" in text and "reached max_steps" in text, r.out
            assert "queue wait unknown: this cluster keeps no job accounting" in text, r.out
            assert "slurmdbd" not in text.replace("(sacct: accounting storage is disabled)", "")
            _check_the_others(lm, others)
    finally:
        release_worker(own, run_name)
