"""The scale harness's parts without a cluster (docs/scale.md): its collective, its checkpoint of tiny
shards made complete by the real protocol, the filesystem counters, the growth laws, and the node
share and per-node timing files that real ranks use too."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import waiting

from lmcore.run.checkpoint_index import newest_complete, verify
from lmtrain.checkpoint.completion import CheckpointError
from lmtrain.distributed.node_share import NodeShare, local_copy, ready_ranks, shares_dev_shm, tasks_on_node
from lmtrain.health.straggler_watch import TimingTable
from lmtrain.observe.timing_lines import TimingLines
from lmtrain.simulate import shards
from lmtrain.simulate.collective import CollectiveError, Star
from lmtrain.simulate.tally import Counts, extrapolate, growth_law

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(world: int, body) -> list:
    port, out, errors = _free_port(), [None] * world, []

    def run(rank: int) -> None:
        try:
            star = Star(rank, world, "127.0.0.1", port, timeout_s=waiting.HANG_S)
            out[rank] = body(rank, star)
        except Exception as exc:  # reported by the test
            errors.append((rank, exc))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(waiting.HANG_S)
    return [out, errors]


def test_the_star_reduces_with_max_over_every_rank_and_a_lost_rank_fails_the_others():
    def body(rank, star):
        first = star.allreduce_max([float(rank), -float(rank), 0.0, 1e-300 if rank == 2 else -1e300])
        star.barrier()
        second = star.allreduce_max([1.0 if rank == 3 else 0.0])
        star.close()
        return first, second

    out, errors = _ranks(4, body)
    assert not errors, errors
    assert all(o == ([3.0, 0.0, 0.0, 1e-300], [1.0]) for o in out), out

    def dies(rank, star):
        if rank == 1:
            star.close()  # its process ended
            return None
        return star.allreduce_max([0.0])

    out, errors = _ranks(3, dies)
    assert {r for r, e in errors} == {0, 2} and all(isinstance(e, CollectiveError) for _, e in errors), errors


def _plan(tmp_path: Path, world: int) -> SimpleNamespace:
    from lmcore.job.parallelism import Parallelism

    par = Parallelism.of_meta({"strategy": "ddp", "world_size": world})
    return SimpleNamespace(paths=SimpleNamespace(checkpoint_dir=str(tmp_path / "checkpoints")), parallelism=par,
                           job_spec=lambda: SimpleNamespace(checkpoint=SimpleNamespace(keep_last=2)))


def test_tiny_shards_are_completed_and_pruned_by_the_real_protocol_and_read_back(tmp_path):
    plan = _plan(tmp_path, 2)

    def body(rank, star):
        env = SimpleNamespace(rank=rank, world_size=2)
        for step in (10, 20, 30):
            shards.save(star, plan, env, step, size=1000, identity={"job_id": "5", "attempt": 1})
        star.close()

    out, errors = _ranks(2, body)
    assert not errors, errors
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-20", "step-30"]  # keep_last 2
    newest = newest_complete(ckpt_dir)
    assert newest.step == 30 and newest.meta()["world_size"] == 2 and newest.meta()["format"] == 1
    assert verify(newest.path) == []  # every shard against COMPLETE's checksums
    for rank in (0, 1):
        shards.load(newest, SimpleNamespace(rank=rank, world_size=2))
    (newest.path / "shard-rank-1.bin").write_bytes(shards.shard_bytes(20, 1, 1000))  # an older step's bytes
    with pytest.raises(CheckpointError, match="does not hold what rank 1 wrote at step 30"):
        shards.load(newest, SimpleNamespace(rank=1, world_size=2))
    assert verify(newest.path)  # and the checksums say so too
    with pytest.raises(CheckpointError, match="holds the shards of 2 ranks and this attempt has 4"):
        shards.load(newest, SimpleNamespace(rank=0, world_size=4))


COUNTED = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from lmtrain.simulate import fs_count
    run, out = Path(sys.argv[1]), sys.argv[2]
    fs_count.install(run, out, {"rank": 3, "job": "9", "role": "task"})
    (run / "logs").mkdir()
    (run / "logs" / "rank-3.log").write_text("x")      # open_write
    fs_count.phase("step")
    (run / "logs" / "rank-3.log").exists()              # stat
    os.listdir(run / "logs")                            # listdir
    fs_count.step_done("step")
    fs_count.phase("checkpoint")
    os.replace(run / "logs" / "rank-3.log", run / "logs" / "rank-3.old")
    Path("/tmp").exists()                               # outside the run directory: not counted
    pid = os.fork()
    if pid == 0:                                        # a forked process counts from zero
        (run / "child").read_text() if (run / "child").exists() else None
        os._exit(0)
    os.waitpid(pid, 0)
""")


def test_the_counters_see_a_processs_operations_under_the_run_directory_by_phase(tmp_path):
    run, out = tmp_path / "run", tmp_path / "counts"
    run.mkdir()
    script = tmp_path / "counted.py"
    script.write_text(COUNTED)
    subprocess.run([sys.executable, str(script), str(run), str(out)], check=True,
                   env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}"})
    counts = Counts.read(out)
    assert len(counts.processes) == 1  # the forked child ended with os._exit: no atexit, nothing written
    p = counts.processes[0]
    assert p["rank"] == 3 and p["frameworks"] == []
    assert p["phases"]["start"] == {"mkdir": 1, "open_write": 1}
    assert p["phases"]["step"] == {"stat": 1, "listdir": 1} and p["steps"] == {"step": 1}
    assert p["phases"]["checkpoint"] == {"rename": 1}
    assert p["paths"]["step"] == {"stat logs/rank-N.log": 1, "listdir logs": 1}
    assert counts.ranks_of() == {3} and counts.total("step") == 2 and counts.steps("step") == 1


@pytest.mark.parametrize("values, law", [
    ([7, 7, 7, 7], "flat"),
    ([5 + 2 * n for _, n in ((8, 2), (32, 8), (32, 32), (128, 32))], "per node"),
    ([5 + 3 * r for r, _ in ((8, 2), (32, 8), (32, 32), (128, 32))], "per rank"),
    ([1 + 2 * n + 3 * r for r, n in ((8, 2), (32, 8), (32, 32), (128, 32))], "per node + per rank"),
    ([r * r for r, _ in ((8, 2), (32, 8), (32, 32), (128, 32))], "per rank squared"),
])
def test_growth_laws_tell_per_node_from_per_rank_when_the_ranks_per_node_differ(values, law):
    sizes = [(8, 2), (32, 8), (32, 32), (128, 32)]
    found = growth_law(sizes, values)
    assert found["law"] == law, found
    assert extrapolate(found, 16384, 2048) == pytest.approx(
        {"flat": 7, "per node": 5 + 2 * 2048, "per rank": 5 + 3 * 16384, "per node + per rank": 1 + 2 * 2048 + 3 * 16384,
         "per rank squared": 16384 ** 2}[law], rel=1e-3)


def test_the_node_share_is_srun_s_node_and_one_stat_a_look_copies_a_changed_file(tmp_path):
    env = {"SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURMD_NODENAME": "gpu-7", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
           "LMLAUNCH_NODE_LOCAL": str(tmp_path / "shm")}
    assert tasks_on_node(env, 2) == 3 and tasks_on_node(env, 0) == 4 and tasks_on_node({}, 0) is None
    share = NodeShare.of_task(env, "81", "1795-77")
    assert share is not None and not share.leader and share.node_tasks == 3 and share.dir.parent == tmp_path / "shm"
    assert NodeShare.of_task({}, "81", "b7") is None  # not a SLURM task: every agent looks itself
    assert shares_dev_shm(None) and shares_dev_shm("podman") and not shares_dev_shm("pyxis")
    leader = dataclasses.replace(share, local_rank=0)
    shared, seen = tmp_path / "profile-request.json", {}
    leader.copy_if_changed(shared, shared.name, seen)
    assert not leader.dir.exists()  # nothing to copy yet
    shared.write_text('{"id": "a", "steps": 2}')
    leader.copy_if_changed(shared, shared.name, seen)
    assert share.read(shared.name) == '{"id": "a", "steps": 2}'
    (leader.dir / shared.name).write_text("stale")
    leader.copy_if_changed(shared, shared.name, seen)  # unchanged mtime: not read again
    assert share.read(shared.name) == "stale"
    share.say_ready("k")
    NodeShare(share.dir, 2, 2, 3).say_ready("k")
    assert leader.ready_here("k") == 2
    ready = tmp_path / "ready"
    ready.mkdir()
    (ready / "node-1").write_text("4\n")
    (ready / "node-2").write_text("3\n")
    (ready / "node-3").write_text("")  # being written
    assert ready_ranks(ready) == 7
    # a leader's start: this job's directories of earlier runs of the batch script on this node go (a requeue
    # kills the step before its leader removes its own); another node's, another job's stay
    uid, shm = os.getuid(), tmp_path / "shm"
    names = [f"lmlaunch-{uid}-81-b1-2-gpu-7", f"lmlaunch-{uid}-81-b1-2-gpu-17", f"lmlaunch-{uid}-810-b1-2-gpu-7"]
    for name in names:
        (shm / name).mkdir()
    assert [p.name for p in leader.remove_earlier()] == [names[0]]
    assert sorted(p.name for p in shm.iterdir()) == sorted([share.dir.name, *names[1:]])
    os.environ.pop("LMLAUNCH_NODE_SHARE", None)
    assert local_copy(shared) == shared
    os.environ["LMLAUNCH_NODE_SHARE"] = str(share.dir)
    try:
        assert local_copy(shared) == share.dir / "profile-request.json"
    finally:
        del os.environ["LMLAUNCH_NODE_SHARE"]


def test_a_nodes_ranks_append_to_one_timing_file_and_the_watch_reads_one_file_per_node(tmp_path):
    files = [tmp_path / f"timing-node-{n}.jsonl" for n in (0, 1)]
    writers = [TimingLines(files[r // 2], rank=r, node=f"n{r // 2 + 1}") for r in range(4)]
    for step in (5, 10):
        for r, w in enumerate(writers):
            w.write(step, steps=5, micro_batches=5, totals={"forward": 0.5 * (3 if r == 3 else 1)}, wall_s=1.0)
    for w in writers:
        w.close()
    assert [len(f.read_text().splitlines()) for f in files] == [4, 4]
    assert {json.loads(x)["rank"] for x in files[1].read_text().splitlines()} == {2, 3}
    table = TimingTable(files, world=4)
    table.read()
    got = table.table()
    assert got.shape == (2, 4) and list(got[0]) == pytest.approx([0.1, 0.1, 0.1, 0.3])
    assert table.nodes == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
