"""End to end: `lmlaunch submit jobs/tiny-cpu.yaml` on the local cluster trains to completion on
two SLURM nodes (DDP on gloo, one task per node). Everything is checked from the job's own
outputs: the ledger, the heartbeat, the per-attempt rank logs, accounting and the run dir."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest
from slurm_helpers import REPO, wait_accounted, wait_terminal

from launcher.runs import registry as runs
from lmcore.run.rank_logs import rank_text
from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs these on the other SLURM version too

MAX_STEPS = 30
OVERRIDES = (
    f"trainer.max_steps={MAX_STEPS}",
    "optim.warmup_steps=3",
    "trainer.val_check_interval=15",
    "trainer.log_every_n_steps=5",
    "checkpoint.every_n_steps=15",
)


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_tiny_cpu_job_trains_to_completion_on_two_nodes(slurm_cluster, cli, lm_env, run_name, own_jobs):
    r = cli("submit", str(REPO / "jobs" / "tiny-cpu.yaml"), f"name={run_name}", *OVERRIDES)
    assert r.code == 0, r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    plan = json.loads((run_dir / "plan.json").read_text())

    state = wait_terminal(job_id)
    logs = sorted((run_dir / "logs").rglob("*.log"))
    tail = "\n".join(p.read_text(errors="replace")[-2000:] for p in logs[:2])
    err_tail = "\n".join(p.read_text(errors="replace")[-2000:] for p in (run_dir / "submitit").glob("*_log.err"))
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{tail}\n{err_tail}"
    acct = wait_accounted(job_id)
    assert acct.state == "COMPLETED" and acct.nodes == "n[1-2]"

    # the ledger: one attempt on n1 and n2, world size 2, completed
    ledger = _jsonl(run_dir / "attempts.jsonl")
    starts = [e for e in ledger if e["event"] == "start"]
    ends = [e for e in ledger if e["event"] == "end"]
    assert len(starts) == 1 and starts[0]["nodes"] == ["n1", "n2"] and starts[0]["world_size"] == 2
    assert starts[0]["job_id"] == job_id and starts[0]["attempt"] == 1
    assert len(ends) == 1 and ends[0]["reason"] == "completed" and ends[0]["end_step"] == MAX_STEPS
    assert (run_dir / "DONE").exists()

    # the attempt ran the run's code snapshot (PYTHONPATH and --chdir of the plan), not the checkout
    record = json.loads((run_dir / "logs" / "attempt-1" / "environment.json").read_text())
    assert record["code"]["from_snapshot"] is True, record["code"]
    assert record["nodes"] == ["n1", "n2"] and record["packages"]["torch"]

    # the heartbeat: steps up to max_steps at world size 2, and the loss falls
    beats = _jsonl(run_dir / "metrics" / "heartbeat.jsonl")
    steps = [b for b in beats if b["event"] == "step"]
    assert steps and all(b["world_size"] == 2 and b["job_id"] == job_id for b in steps)
    assert max(b["step"] for b in steps) == MAX_STEPS
    losses = [b["loss"] for b in steps]
    assert len(losses) >= 4
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses

    # each rank's lines of its node's log for attempt 1: each reports the rendezvous on the first node
    for rank in (0, 1):
        text = rank_text(run_dir / "logs" / "attempt-1", rank)
        m = re.search(r"rank (\d+)/(\d+).*master (\S+):(\d+)", text)
        assert m, text[:2000]
        assert (int(m.group(1)), int(m.group(2)), m.group(3)) == (rank, 2, "n1")

    # the planned environment was exported to every task (the script is the plan's; see
    # test_submit_task_env.py for the variables as each task saw them)
    script = (run_dir / "submitit" / f"{job_id}_submission.sh").read_text()
    for name in plan["env"]:
        assert re.search(rf"^export {name}=", script, re.M), name

    # private directories
    for d in (run_dir, run_dir / "submitit", run_dir / "logs"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert runs.load_record(run_name, lm_env).job_ids == [job_id]
    assert slurm.state_group(acct.state) == "completed"
