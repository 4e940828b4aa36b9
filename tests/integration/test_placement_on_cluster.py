"""Placement on a real SLURM topology: a worker cluster of 8 nodes with two leaf switches of 4
(topology/tree, SLURM 22.05) or four blocks of 2 (topology/block, SLURM 23.11 and later), its profile
read off it by `lmlaunch profile init`.

- One node kept busy, and a 4-node pp2 x dp2 job that must not touch that node's switch or block;
  what the job got is read from sacct and from the ranks' own records.
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
from slurm_helpers import job_name, release_worker

from launcher.localcluster import cluster, workers
from lmcore.errors import UserError
from lmcore.slurm import admin as rehearsal, client as slurm
from lmcore.task_records import read_task_records

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs it on the other SLURM version too

VERSION = os.environ.get("LMLAUNCH_TEST_SLURM") or None
NODES = tuple(f"n{i}" for i in range(1, 9))


def _block_topology(version: str) -> bool:
    return tuple(int(p) for p in version.split(".")[:2]) >= (23, 11)


@pytest.fixture(scope="module")
def topology_cluster(slurm_cluster):
    """A worker cluster of this test's own: 8 nodes, tree:2x4 or block:4x2 by the SLURM version;
    back to 2 nodes without a topology afterwards."""
    from launcher.localcluster.config import native_version

    version = VERSION or native_version() or "22.05"
    text = "block:4x2" if _block_topology(version) else "tree:2x4"
    claim = workers.claim(VERSION)
    lines: list[str] = []
    try:
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, accounting=True,
                   min_job_age=300, version=VERSION, topology=text)
        with cluster.own_conf(claim.layout):
            assert cluster.nodes_ready(NODES), lines
        yield claim, text
    finally:
        with cluster.own_conf(claim.layout), contextlib.suppress(UserError):
            rehearsal.set_node_state("n2", "RESUME")  # a node failure leaves it DOWN
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, version=VERSION,
                   nodes=2, topology="none")
        release_worker(claim, "pl-")


def _profile(claim, lm_env, tmp_path) -> dict[str, str]:
    """A profile read off the topology cluster by `profile init`; the environment that uses it."""
    profiles = tmp_path / "profiles"
    env = {**lm_env, **claim.environ(), "LMLAUNCH_PROFILES_DIR": str(profiles)}
    with cluster.own_conf(claim.layout):  # SLURM's commands here read this cluster, as a user's shell would
        code, out, err = lm(env, "profile", "init", "topo", "-o", str(profiles / "topo.yaml"))
    assert code == 0, out + err
    return env


def test_a_job_asked_to_stay_inside_one_switch_or_block_gets_one_and_its_pipelines_lie_inside_a_group(
        topology_cluster, lm_env, tmp_path):
    claim, text = topology_cluster
    block = text.startswith("block")
    env = _profile(claim, lm_env, tmp_path)
    said = (tmp_path / "profiles" / "topo.yaml").read_text()
    want = ('"b3": "n[5-6]"' if block else '"s2": "n[5-8]"')
    assert want in said and f"topology: {'block' if block else 'tree'}" in said, said

    name = job_name("pl", "pp")
    # pp2 x dp2 on 4 nodes: each data-parallel replica's two stages on two consecutive nodes
    job_args = (f"name={name}", "cluster=topo", *BASE, "trainer.max_steps=4", "checkpoint.every_n_steps=100",
                "resources.nodes=4", "resources.tasks_per_node=1", "trainer.strategy=fsdp",
                "trainer.pipeline_parallel_size=2", "data.micro_batch_size=4", "trainer.global_batch_size=16",
                "resources.placement.within=auto" if block else "resources.placement.within=switch")
    # what can never be: a segment larger than a block, more nodes than a switch holds
    bad, why = ((("resources.placement.segment=4",), "segment(4) is larger than the base block (2 nodes)") if block else
                (("resources.nodes=8", "trainer.global_batch_size=32"), "the job's 8 nodes never fit in one switch"))
    code, out, err = lm(env, "submit", SPEC, *job_args, *bad, "--dry-run")
    assert code == 2 and why in err, out + err
    code, out, err = lm(env, "submit", SPEC, *job_args, "--dry-run")
    option = "#SBATCH --segment=2" if block else "#SBATCH --switches=1"
    assert code == 0 and option in out, out + err
    assert "#   node 1: ranks 1-1  stage(s) 1  replica(s) 0" in out, out

    busy = ""
    with cluster.own_conf(claim.layout):  # n2 busy: its block (n1, n2) or switch (n1-n4) cannot hold the job
        busy = subprocess.run(["sbatch", "--parsable", "-p", "low", "-w", "n2", "--exclusive", "-N1", "-J", f"{name}-busy",
                               "-o", "/dev/null", "--wrap", "sleep 600"], capture_output=True, text=True, check=True,
                              env={**os.environ, **claim.environ()}).stdout.strip().split(";")[0]
    try:
        with cluster.own_conf(claim.layout):
            code, out, err = lm(env, "submit", SPEC, *job_args)
        assert code == 0, out + err
        job = re.search(r"job (\d+)", out).group(1)
        run_dir = Path(env["LMLAUNCH_RUNS_ROOT"]) / name
        with cluster.own_conf(claim.layout):
            finish(job, run_dir)
            got = slurm.sacct([job])
        nodes = got[0].nodes if got else ""
        assert nodes == "n[5-8]", got  # never n1 or n3/n4 beside the busy n2
        records, problems = read_task_records(run_dir, job, 0)
        assert not problems and len(records) == 4, problems
        where = {(r.replica, r.stage): (r.node, r.group) for r in records}
        for replica in (0, 1):  # both stages of a replica inside one group
            assert where[(replica, 0)][1] == where[(replica, 1)][1] is not None, where
        if block:
            assert {where[(0, 0)][1], where[(1, 0)][1]} == {"b3", "b4"}, where
        start = json.loads(next(line for line in (run_dir / "attempts.jsonl").read_text().splitlines()
                                if '"start"' in line))
        assert start["groups"] == {r.node: r.group for r in records}, start
    finally:
        with contextlib.suppress(UserError), cluster.own_conf(claim.layout):
            slurm.cancel([busy] if busy else [])


def test_a_restart_in_place_takes_the_spares_of_the_failed_nodes_switch_or_block(topology_cluster, lm_env, tmp_path):
    claim, text = topology_cluster
    block = text.startswith("block")
    env = _profile(claim, lm_env, tmp_path)
    name = job_name("pl", "spare")
    with cluster.own_conf(claim.layout):
        # a pipeline over 2 nodes, 2 spares: blocks of 2 put them in another block (--segment=2); a
        # switch of 4 holds all four (--switches=1)
        job, run_dir = submit(env, name, "cluster=topo", "trainer.max_steps=40", "resources.spare_nodes=2",
                              "trainer.strategy=fsdp", "trainer.pipeline_parallel_size=2",
                              "resources.placement.within=auto")
        wait_step(run_dir, 3, attempt=1)
        assert starts(run_dir)[0]["nodes"] == ["n1", "n2"], starts(run_dir)
        r = preempt(env, name, "node-failure")  # the last node the ranks run on
        assert r["node"] == "n2", r
        finish(job, run_dir)
    end = ends(run_dir)[0]
    assert (end["reason"], end["restart"], end["left_out"]) == ("node_failure", "in_place", ["n2"]), end
    second = starts(run_dir)[1]
    if block:  # b1 has no whole pipeline left: the ranks move to b2 (SLURM's first free pair, n1 + n3, straddles)
        assert (second["nodes"], end["held_back"]) == (["n3", "n4"], ["n1"]), (second, end)
        assert "a spare takes its place (n3 of b2, n4 of b2)" in end["detail"], end
    else:  # the spare of the same switch
        assert second["nodes"] == ["n1", "n3"] and "(n3 of the same s1)" in end["detail"], (second, end)
    assert second["job_id"] == job and len({second["groups"][n] for n in second["nodes"]}) == 1, second
    assert ends(run_dir)[-1]["reason"] == "completed", ends(run_dir)
