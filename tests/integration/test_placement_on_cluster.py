"""Placement on a real SLURM topology: a worker cluster of 8 nodes in four leaf switches of 2
(topology/tree, SLURM 22.05) or four blocks of 2 (topology/block, SLURM 23.11 and later), its profile
read off it by `lmlaunch profile init`.

- One node kept busy; a 2-node job asked to stay inside one switch or block, and a 4-node
  pp2 x dp2 job whose pipelines must each stay inside one (within: auto: --switches=2 or
  --segment=2): what they got is read from sacct and from the ranks' own records.
- A pipeline over 2 nodes with 2 spare nodes loses a node (`lmlaunch preempt --mode node-failure`):
  the restart in place takes its spares by switch or block, never SLURM's first free node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from preempt_helpers import BASE, SPEC, ends, finish, lm, preempt, starts, submit, wait_step
from slurm_helpers import job_name, own_worker_cluster, profile_off

from launcher.localcluster import cluster
from lmcore.errors import UserError
from lmcore.run.task_records import read_task_records
from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs it on the other SLURM version too

VERSION = os.environ.get("LMLAUNCH_TEST_SLURM") or None
NODES = tuple(f"n{i}" for i in range(1, 9))


def _block_topology(version: str) -> bool:
    return tuple(int(p) for p in version.split(".")[:2]) >= (23, 11)


@pytest.fixture(scope="module")
def topology_cluster(slurm_cluster):
    """A worker cluster of this module's own: 8 nodes in 4 leaf switches (tree:4x2) or 4 blocks
    (block:4x2) of 2, by the SLURM version; back to 2 nodes without a topology afterwards."""
    from launcher.localcluster.config import native_version

    version = VERSION or native_version() or "22.05"
    text = "block:4x2" if _block_topology(version) else "tree:4x2"
    with own_worker_cluster("pl-", nodes=len(NODES), topology=text) as claim:
        yield claim, text


def _profile(claim, lm_env, tmp_path) -> dict[str, str]:
    """A profile read off the topology cluster by `profile init`; the environment that uses it."""
    return profile_off(claim, lm_env, tmp_path / "profiles", "topo")


def _lm_job(env: dict[str, str], claim, *args: str) -> str:
    with cluster.own_conf(claim.layout):
        code, out, err = lm(env, "submit", SPEC, *args)
    assert code == 0, out + err
    return re.search(r"job (\d+)", out).group(1)


def test_jobs_asked_to_stay_inside_switches_or_blocks_get_them_and_their_pipelines_lie_inside_one(
        topology_cluster, lm_env, tmp_path):
    claim, text = topology_cluster
    block = text.startswith("block")
    word = "block" if block else "switch"
    env = _profile(claim, lm_env, tmp_path)
    said = (tmp_path / "profiles" / "topo.yaml").read_text()
    assert f'"{"b2" if block else "s2"}": "n[3-4]"' in said and f"topology: {'block' if block else 'tree'}" in said, said

    pair, four = job_name("pl", "pair"), job_name("pl", "pp")
    small = (f"name={pair}", "cluster=topo", *BASE, "trainer.max_steps=4", "checkpoint.every_n_steps=100",
             f"resources.placement.within={word}")
    # pp2 x dp2 on 4 nodes: each data-parallel replica's two stages on two consecutive nodes
    pp = (f"name={four}", "cluster=topo", *BASE, "trainer.max_steps=4", "checkpoint.every_n_steps=100",
          "resources.nodes=4", "resources.tasks_per_node=1", "trainer.strategy=fsdp",
          "trainer.pipeline_parallel_size=2", "data.micro_batch_size=4", "trainer.global_batch_size=16")
    # what can never be: 4 nodes inside one switch or block of 2
    with cluster.own_conf(claim.layout):  # the dry run asks this cluster's controller, as submit would
        code, out, err = lm(env, "submit", SPEC, *pp, f"resources.placement.within={word}", "--dry-run")
        assert code == 4 and f"the job's 4 nodes never fit in one {word}" in err and "has 2" in err, out + err
        code, out, err = lm(env, "submit", SPEC, *pp, "resources.placement.within=auto", "--dry-run")
    assert out.startswith("# the cluster would take it (sbatch --test-only: "), out[:300]
    assert code == 0 and ("#SBATCH --segment=2" if block else "#SBATCH --switches=2") in out, out + err
    assert "#   node 1: ranks 1-1  stage(s) 1  replica(s) 0" in out, out

    busy = ""
    with cluster.own_conf(claim.layout):  # n2 busy: its switch or block (n1, n2) cannot hold a job
        busy = subprocess.run(["sbatch", "--parsable", "-p", "low", "-w", "n2", "--exclusive", "-N1", "-J", f"{pair}-busy",
                               "-o", "/dev/null", "--wrap", "sleep 600"], capture_output=True, text=True, check=True,
                              env={**os.environ, **claim.environ()}).stdout.strip().split(";")[0]
    try:
        jobs = {pair: _lm_job(env, claim, *small), four: _lm_job(env, claim, *pp, "resources.placement.within=auto")}
        runs = Path(env["LMLAUNCH_RUNS_ROOT"])
        with cluster.own_conf(claim.layout):
            for name, job in jobs.items():
                finish(job, runs / name)
            got = {r.job_id: r.nodes for r in slurm.sacct(list(jobs.values()))}
        from hostlist import expand_hostlist

        pair_nodes = expand_hostlist(got[jobs[pair]])
        assert len(pair_nodes) == 2 and not {"n1", "n2"} & set(pair_nodes), got  # never n1 beside the busy n2
        assert int(pair_nodes[0][1:]) % 2 == 1 and int(pair_nodes[1][1:]) == int(pair_nodes[0][1:]) + 1, got  # one group
        records, problems = read_task_records(runs / four, jobs[four], 0)
        assert not problems and len(records) == 4, problems
        assert not {"n1", "n2"} & {r.node for r in records}, records
        where = {(r.replica, r.stage): r.group for r in records}
        for replica in (0, 1):  # both stages of a replica inside one switch or block, read from the ranks
            assert where[(replica, 0)] == where[(replica, 1)] is not None, where
        start = json.loads(next(line for line in (runs / four / "attempts.jsonl").read_text().splitlines()
                                if '"start"' in line))
        assert start["groups"] == {r.node: r.group for r in records}, start
    finally:
        with contextlib.suppress(UserError), cluster.own_conf(claim.layout):
            slurm.cancel([busy] if busy else [])


def test_a_restart_in_place_takes_the_spares_by_switch_or_block(topology_cluster, lm_env, tmp_path):
    claim, _ = topology_cluster
    env = _profile(claim, lm_env, tmp_path)
    name = job_name("pl", "spare")
    with cluster.own_conf(claim.layout):
        # a pipeline over 2 nodes, 2 spares: the spares in another block or switch of 2 (--segment=2,
        # --switches=2)
        job, run_dir = submit(env, name, "cluster=topo", "trainer.max_steps=40", "resources.spare_nodes=2",
                              "trainer.strategy=fsdp", "trainer.pipeline_parallel_size=2",
                              "resources.placement.within=auto")
        wait_step(run_dir, 3, attempt=1)
        first = starts(run_dir)[0]  # SLURM picks the pair of blocks or switches; the ranks on the first two nodes
        (kept, lost), spares = first["nodes"], first["spares"]
        assert len(spares) == 2 and len({first["groups"][n] for n in (kept, lost)}) == 1, first
        r = preempt(env, name, "node-failure")  # the last node the ranks run on
        assert r["node"] == lost, r
        finish(job, run_dir)
    end = ends(run_dir)[0]
    assert (end["reason"], end["restart"], end["left_out"]) == ("node_failure", "in_place", [lost]), end
    second = starts(run_dir)[1]
    # the failed node's switch or block has no whole pipeline left: the ranks move to the spares' one
    # (SLURM's first free pair, the kept node and a spare, would straddle the two)
    group = second["groups"][spares[0]]
    assert (second["nodes"], end["held_back"]) == (spares, [kept]), (second, end)
    assert f"a spare takes its place ({spares[0]} of {group}, {spares[1]} of {group})" in end["detail"], end
    assert second["job_id"] == job and len({second["groups"][n] for n in second["nodes"]}) == 1, second
    assert ends(run_dir)[-1]["reason"] == "completed", ends(run_dir)
