"""The scale harness (lmtrain.simulate, jobs/scale-sim.yaml) at 32 ranks on 8 nodes of a worker cluster of
its own: ranks that import no torch run lmlaunch's per-rank machinery through a crash, a restart in
place, a preemption and a resume, every rank accounted for at every attempt (docs/scale.md).

1. attempt 1: rank 31 is SIGKILLed at step 40 (lmtrain.faults); the others' all-reduce fails, rank 0
   decides a restart in place, every task's agent forks again (attempt 2, same job, same nodes);
2. attempt 2: held at step 81 (lmtrain.faults' gate), `lmlaunch preempt --mode signal`: the stop agreed by all 32 ranks,
   a checkpoint of 32 shards, the job requeued (started at once here);
3. attempt 3: every shard verified against COMPLETE's checksums and read back, training to step 160.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from preempt_helpers import ends, finish, held_at, lm, preempt, starts, wait_held
from slurm_helpers import faults, job_name, own_worker_cluster

from launcher.localcluster import cluster
from lmcore.run.rank_logs import ranks_texts
from lmcore.slurm import client as slurm
from lmtrain.simulate.tally import Counts

VERSION = os.environ.get("LMLAUNCH_TEST_SLURM") or None
NODES, TASKS = 8, 4
RANKS = NODES * TASKS
SPEC = Path(__file__).resolve().parents[2] / "jobs" / "scale-sim.yaml"


@pytest.fixture(scope="module")
def eight_nodes(slurm_cluster):
    """A worker cluster of this module's own with 8 nodes; back to 2 afterwards."""
    with own_worker_cluster("sc-", nodes=NODES) as claim:
        yield claim


def _rank_lines(run_dir: Path, attempt: int) -> dict[int, str]:
    texts = ranks_texts(run_dir / "logs" / f"attempt-{attempt}")  # the node logs, by rank
    return {rank: "\n".join(texts.get(rank, [])) for rank in range(RANKS)}


def test_32_ranks_crash_restart_in_place_preempt_and_resume_every_rank_accounted_for(eight_nodes, lm_env, tmp_path):
    claim = eight_nodes
    env = {**lm_env, **claim.environ()}
    name, counts_dir = job_name("sc", "harness"), tmp_path / "counts"
    kill = {"point": "train.batch_end", "attempt": 1, "step": 40, "rank": RANKS - 1, "action": "kill"}
    with cluster.own_conf(claim.layout), faults(kill, held_at(81, attempt=2)):  # held until the preemption's signal
        code, out, err = lm(env, "submit", SPEC, f"name={name}", f"resources.nodes={NODES}",
                            f"resources.tasks_per_node={TASKS}", f"trainer.global_batch_size={RANKS}",
                            "trainer.max_steps=160", "checkpoint.every_n_steps=50", f"simulate.counts_dir={counts_dir}")
    assert code == 0, out + err
    job = out.split("job ", 1)[1].split()[0]
    run_dir = Path(env["LMLAUNCH_RUNS_ROOT"]) / name
    with cluster.own_conf(claim.layout):
        wait_held(run_dir, 81, attempt=2, job_id=job)
        preempt(env, name, "signal")
        finish(job, run_dir)
        code, status, err = lm(env, "status", name, "--json")
        code_h, history, err_h = lm(env, "history", name)
    assert code == 0 and code_h == 0, err + err_h

    # the story, from the ledger
    said = [(e["attempt"], e["reason"]) for e in ends(run_dir)]
    assert said == [(1, "crashed"), (2, "preempted"), (3, "completed")], said
    first, second, third = ends(run_dir)
    assert first.get("restart") == "in_place" and first["end_step"] == 40, first
    assert [s["job_id"] for s in starts(run_dir)] == [job] * 3
    stop = second["stop_step"]
    assert [s["start_step"] for s in starts(run_dir)] == [0, 0, stop]  # no checkpoint before step 50 in attempt 1
    assert third["end_step"] == 160

    # every rank, every attempt: its log line, and (but the killed one) its counts
    for attempt in (1, 2, 3):
        lines = _rank_lines(run_dir, attempt)
        missing = [r for r, text in lines.items() if f"attempt {attempt}, rank {r}/{RANKS}" not in text]
        assert not missing, f"attempt {attempt}: no start line from ranks {missing}"
    verified = [r for r, text in _rank_lines(run_dir, 3).items() if f"step-{stop}: every file matches its checksum" in text]
    assert len(verified) == RANKS, f"ranks that verified their share of step-{stop}: {verified}"
    # through the node share: a file per node and the verdict on the shared filesystem, none per rank
    # (lmtrain.checkpoint.verify_exchange)
    checks = sorted(p.name.split(".verify-", 1)[1] for p in (run_dir / "rendezvous").glob("*.verify-*.json"))
    assert checks == sorted(["0.json", *(f"0-node-{n}.json" for n in range(NODES))]), checks
    counts = Counts.read(counts_dir)
    assert counts.ranks_of(attempt=1) == set(range(RANKS - 1))  # rank 31 was SIGKILLed: no counts
    assert counts.ranks_of(attempt=2) == counts.ranks_of(attempt=3) == set(range(RANKS))
    assert counts.ranks_of(role="agent") == set(range(RANKS))
    assert not {m for p in counts.processes for m in p.get("frameworks") or []}, "a harness rank imported a framework"
    # one agent per node looks at rank 0's verdict on the shared filesystem (lmtrain.distributed.node_share):
    # the others read their node's copy, but at most a look or two before their leader made the directory
    def verdict_reads(p: dict) -> int:
        return sum(n for k, n in ((p.get("paths") or {}).get("agent_wait") or {}).items()
                   if k.startswith("open_read rendezvous/") and k.endswith(".next"))
    agents = [p for p in counts.processes if p.get("role") == "agent"]
    leaders = [verdict_reads(p) for p in agents if int(p["rank"]) % TASKS == 0]
    others = [verdict_reads(p) for p in agents if int(p["rank"]) % TASKS]
    # an agent per task per run of the batch script: attempts 1 and 2 (restarted in place), then 3 (requeued)
    assert len(others) == 2 * (RANKS - NODES) and sum(others) <= 2 * len(others) < sum(leaders), (others, leaders)
    # the ranks' timing lines, one file per node holding its 4 ranks' lines, and the final checkpoint
    for attempt in (2, 3):
        logs = run_dir / "logs" / f"attempt-{attempt}"
        assert sorted(p.name for p in logs.glob("timing-*")) == sorted(f"timing-node-{n}.jsonl" for n in range(NODES))
        for node in range(NODES):
            lines = [json.loads(x) for x in (logs / f"timing-node-{node}.jsonl").read_text().splitlines()]
            assert {t["rank"] for t in lines} == set(range(node * TASKS, (node + 1) * TASKS)), (attempt, node)
    final = run_dir / "checkpoints" / "step-160"
    manifest = json.loads((final / "COMPLETE").read_text())
    assert sorted(manifest["files"]) == sorted(["meta.json", *(f"shard-rank-{r}.bin" for r in range(RANKS))])
    assert json.loads((final / "meta.json").read_text())["world_size"] == RANKS

    # the nodes' directories in /dev/shm: the requeued run's leaders removed the earlier run's (killed with
    # its step), and their own at the end
    assert not list(Path("/dev/shm").glob(f"lmlaunch-{os.getuid()}-{job}-b*")), sorted(Path("/dev/shm").iterdir())

    # what the user reads
    row = json.loads(status)[0] if status.lstrip().startswith("[") else json.loads(status)
    assert "COMPLETED" in json.dumps(row), status
    assert "restarted in place" in history and "preempted" in history, history


@pytest.mark.parametrize("shape", [
    (f"resources.nodes={NODES + 1}", f"trainer.global_batch_size={(NODES + 1) * TASKS}"),  # more nodes than the partition
    ("resources.cpus_per_task=2", f"trainer.global_batch_size={2 * TASKS}", "resources.nodes=2"),  # 4 x 2 CPUs on 4-CPU nodes
])
def test_a_shape_no_partition_or_node_holds_is_refused_before_queueing(eight_nodes, lm_env, shape):
    env = {**lm_env, **eight_nodes.environ()}
    name = job_name("sc", "shape")
    with cluster.own_conf(eight_nodes.layout):
        code, out, err = lm(env, "submit", SPEC, f"name={name}", *shape)
        queued = [j for j in slurm.squeue() if j.name == name]
    assert code == 5 and not queued, out + err  # REFUSED: the controller said so
    assert "the cluster cannot run this job as asked (sbatch --test-only: " in err and "nothing was submitted" in err, err
    assert "Requested node configuration is not available" in err, err
    assert not (Path(env["LMLAUNCH_RUNS_ROOT"]) / name).exists()
