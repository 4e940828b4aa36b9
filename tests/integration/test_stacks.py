"""`lmlaunch stacks RUN` on the real local cluster: a 2-node training job (one task on n1, one
on n2) is dumped while it trains, by one `srun --overlap` step running py-spy on each node;
both ranks show their node, their recorded pid and Lightning's training loop; a rank whose
process is gone shows why while the others still show; a run that is not running is refused."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import waiting
from preempt_helpers import SPEC, wait_step
from slurm_helpers import SMALL_MODEL, faults, pace

from lmcore.run.task_records import TaskRecord, read_task_records, write_task_record
from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs these on the other SLURM version too

OVERRIDES = (
    "trainer.max_steps=100000",  # trains until the test cancels it
    "optim.warmup_steps=3",
    "trainer.val_check_interval=null",
    "trainer.log_every_n_steps=1",
    "logging.heartbeat_every_n_steps=1",
    "checkpoint.every_n_steps=100000",
    *SMALL_MODEL,
)
TRAINING_LOOP = re.compile(r"training_step|_TrainingEpochLoop\.run|_FitLoop\.run|Trainer\.fit")


def _sections(text: str) -> dict[int, tuple[str, int, str]]:
    """rank -> (node, pid, body) from the command's text output."""
    parts = re.split(r"^== rank (\d+) on (\S+) \(pid (\d+)\) ==$", text, flags=re.M)
    return {int(parts[i]): (parts[i + 1], int(parts[i + 2]), parts[i + 3]) for i in range(1, len(parts) - 3, 4)}


def test_stacks_show_every_rank_of_a_running_two_node_job_in_its_training_loop(slurm_cluster, cli, lm_env, run_name,
                                                                                own_jobs):
    with faults(pace()):  # it trains while the test looks at it: paced steps, little CPU
        r = cli("submit", str(SPEC), f"name={run_name}", *OVERRIDES)
    assert r.code == 0, r.out + r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    wait_step(run_dir, 3, job_id=job_id)

    records, problems = read_task_records(run_dir, job_id, 0)
    assert not problems and [(t.rank, t.node) for t in records] == [(0, "n1"), (1, "n2")], records
    pids = {t.rank: t.pid for t in records}

    # text: one section per rank, with its node and pid, in the training loop
    r = cli("stacks", run_name)
    assert r.code == 0, r.out + r.err
    assert re.search(rf"run '{run_name}' · attempt 1, job {job_id} on n\[1-2\]", r.out), r.out[:500]
    secs = _sections(r.out)
    assert sorted(secs) == [0, 1], r.out[:3000]
    for rank, node in ((0, "n1"), (1, "n2")):
        got_node, pid, body = secs[rank]
        assert (got_node, pid) == (node, pids[rank])
        assert f"Process {pid}:" in body and "submitit" in body, body[:2000]
        assert TRAINING_LOOP.search(body), body[:4000]
        assert "lmtrain/task/entry.py" in body

    # --json --native, by job id: the same ranks; native frames of torch's libraries appear
    r = cli("stacks", job_id, "--json", "--native")
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert [(d["rank"], d["node"], d["pid"], d["error"]) for d in rows] == [(0, "n1", pids[0], None),
                                                                           (1, "n2", pids[1], None)]
    for d in rows:
        assert TRAINING_LOOP.search(d["stack"]), d["stack"][:4000]
        assert re.search(r"\(lib\S+\.so", d["stack"]), d["stack"][:4000]  # e.g. (libtorch_cpu.so)

    # a rank whose process is gone: its section says so, the others still show, exit code 1
    write_task_record(run_dir, TaskRecord(rank=2, local_rank=1, node="n2", pid=_dead_pid(), job_id=job_id,
                                          restart_count=0, python=records[1].python, time=time.time()))
    r = cli("stacks", run_name, "--json")
    assert r.code == 1, r.out + r.err
    rows = {d["rank"]: d for d in json.loads(r.out)}
    assert rows[0]["error"] is None and rows[1]["error"] is None and TRAINING_LOOP.search(rows[1]["stack"])
    assert rows[2]["stack"] is None and "is gone on n2" in rows[2]["error"], rows[2]
    assert "rank 2" in r.err

    # once the job has ended, the command says so (exit 2) instead of dumping anything
    assert cli("cancel", run_name).code == 0
    _wait_not_active(job_id)
    r = cli("stacks", run_name)
    assert r.code == 2, r.out + r.err
    assert "is not running" in r.err and f"job {job_id}" in r.err and "CANCELLED" in r.err, r.err
    assert r.out == ""


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _wait_not_active(job_id: str) -> None:
    waiting.until(lambda: not any(slurm.is_active(j.state) for j in slurm.squeue([job_id])),
                  progress=waiting.job(job_id), what=f"job {job_id} no longer active")
