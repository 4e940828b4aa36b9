"""lmtrain.checkpoint.verify_exchange: the ranks' checks of a checkpoint reach rank 0 in one file per
node where the node's ranks share node memory (its leader gathers them), and rank 0's verdict is read
from the shared directory by the nodes' leaders alone; per rank without a node share."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmtrain.checkpoint.completion import CheckpointError
from lmtrain.checkpoint.verify_exchange import NodeFiles, RankFiles, exchange_for
from lmtrain.distributed.node_share import training_share

NODES, PER_NODE = 3, 4


def _run_round(tmp_path: Path, problems_of, *, missing: int | None = None, wait_s: float = HANG_S):
    shared = tmp_path / "rendezvous"
    shared.mkdir()
    base = shared / "key-attempt-1.verify"
    world = NODES * PER_NODE
    verdicts: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        node, local = divmod(rank, PER_NODE)
        ex = NodeFiles(base, rank, world, wait_s, share=tmp_path / f"shm-{node}", local_rank=local,
                       node_rank=node, node_tasks=PER_NODE)
        try:
            ex.publish(0, {"step": 10, "problems": problems_of(rank)})
            if rank == 0:
                found = ex.gather(0)
                verdict = {"ok": not found, "found": found}
                ex.announce(0, verdict)
            else:
                verdict = ex.verdict(0)
        except CheckpointError as exc:
            verdict = exc
        verdicts[rank] = verdict

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r != missing]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return shared, verdicts


def test_one_file_per_node_reaches_rank_0_and_every_rank_follows_its_verdict(tmp_path):
    bad = {5: ["step-10/model-rank-5.pt: checksum differs"], 11: ["step-10/model-rank-11.pt: size 3, written 9"]}
    shared, verdicts = _run_round(tmp_path, lambda r: bad.get(r, []))
    assert sorted(p.name for p in shared.iterdir()) == [
        "key-attempt-1.verify-0-node-0.json", "key-attempt-1.verify-0-node-1.json", "key-attempt-1.verify-0-node-2.json",
        "key-attempt-1.verify-0.json"]  # no file per rank on the shared filesystem
    expected = {"ok": False, "found": bad[5] + bad[11]}
    assert verdicts == dict.fromkeys(range(NODES * PER_NODE), expected)
    for node in range(NODES):  # each node's copy of the verdict, for its ranks
        assert (tmp_path / f"shm-{node}" / "key-attempt-1.verify-0-verdict.json").is_file()


def test_a_rank_that_never_checks_ends_its_node_and_rank_0_with_a_reason(tmp_path):
    _shared, verdicts = _run_round(tmp_path, lambda r: [], missing=6, wait_s=2.0)
    assert "3 of node 1's 4 ranks checked their share" in str(verdicts[4])  # node 1's leader
    assert "counted 8 of 12 ranks" in str(verdicts[0])


def test_without_a_node_share_the_ranks_use_a_file_each(tmp_path):
    env = SimpleNamespace(rank=1, world_size=4, node_rank=0, local_rank=1)
    base = tmp_path / "key.verify"
    assert training_share({}, 0) is None
    assert training_share({"LMLAUNCH_NODE_SHARE": str(tmp_path)}, 0) is None  # no SLURM step: no node count
    node = training_share({"LMLAUNCH_NODE_SHARE": str(tmp_path), "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, 0)
    assert node == (tmp_path, 2)
    assert type(exchange_for(base, env, 5.0, None)) is RankFiles
    assert isinstance(exchange_for(base, env, 5.0, node), NodeFiles)
    RankFiles(base, 1, 4, 5.0).publish(0, {"step": 1, "problems": []})
    assert (tmp_path / "key.verify-0-rank-1.json").is_file()
    with pytest.raises(CheckpointError, match="did not appear within 0s"):
        RankFiles(base, 0, 4, 0.0).gather(0)
