"""lmcore.slurm.client's parsers on what each SLURM version of the local cluster really answered:
22.05 (Debian 12) and 24.11 (Debian 13), recorded by `python tests/slurm_replay.py capture DIR`
from the same scenario (a held job, a running two-node job, that job cancelled) and replayed here
(tests/slurm_replay.py). A version whose answers change shape fails here, not on a user's cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_replay import phase, replaying

from lmcore.slurm import client as slurm

OUTPUTS = Path(__file__).parent / "slurm_outputs"
VERSIONS = ("22.05", "24.11")


@pytest.fixture(params=VERSIONS)
def recorded(request):
    src = OUTPUTS / request.param
    scenario = json.loads((src / "scenario.json").read_text())
    assert scenario["version"].startswith(request.param), scenario
    with replaying(src):
        yield scenario


def test_the_controller_nodes_and_partitions(recorded):
    with phase("live"):
        assert slurm.ping()
        nodes = {n.name: n for n in slurm.nodes()}
        assert set(nodes) == {"n1", "n2"}
        assert all(n.cpus == 4 and set(n.partitions) == {"low", "high"} and n.state in ("mix", "alloc")
                   for n in nodes.values()), nodes
        parts = {p.name: p for p in slurm.partitions()}
        assert parts["low"].default and not parts["high"].default and parts["low"].time_limit == "2:00:00"
        assert parts["low"].nodes == "n[1-2]" and parts["low"].available == "up"
        configs = {c["PartitionName"]: c for c in slurm.partition_configs()}
        assert (configs["low"]["PreemptMode"], configs["low"]["GraceTime"], configs["low"]["PriorityTier"]) == \
            ("REQUEUE", "30", "1")
        assert (configs["high"]["PreemptMode"], configs["high"]["PriorityTier"]) == ("OFF", "10")
        assert {c["NodeName"]: c["CPUTot"] for c in slurm.node_configs()} == {"n1": "4", "n2": "4"}
        cfg = slurm.config()
        assert cfg["ClusterName"] == "lmlaunch" and cfg["PreemptType"] == "preempt/partition_prio"
        assert cfg["SLURM_VERSION"] == recorded["version"] and cfg["MinJobAge"] == "300 sec"


def test_a_held_and_a_running_job(recorded):
    held, running = recorded["held"], recorded["running"]
    with phase("live"):
        q = {j.job_id: j for j in slurm.squeue([held, running])}
        assert (q[held].state, q[held].reason, q[held].group, q[held].num_nodes) == ("PENDING", "JobHeldUser", "queued", 1)
        r = q[running]
        assert (r.state, r.group, r.num_nodes, r.nodelist, r.partition, r.restarts, r.time_limit) == \
            ("RUNNING", "running", 2, "n[1-2]", "low", 0, "2:00:00")
        assert slurm.parse_time(r.start) is not None and slurm.parse_time(r.submit) is not None
        info = slurm.show_job(running)
        assert info is not None
        assert (info["JobState"], info["NumNodes"], info["Restarts"], info["Requeue"], info["JobName"]) == \
            ("RUNNING", "2", "0", "1", "replay-running")
        assert slurm.parse_duration(info["TimeLimit"]) == 7200
        assert slurm.show_job("999999") is None  # forgotten (or never known): None, not an error
        assert slurm.squeue(["999999"]) == []
        acct = {a.job_id: a for a in slurm.sacct([held, running], duplicates=True)}
        assert (acct[held].state, acct[running].state, acct[running].nodes) == ("PENDING", "RUNNING", "n[1-2]")


def test_the_same_job_cancelled(recorded):
    running = recorded["running"]
    with phase("ended"):
        (q,) = slurm.squeue([running])  # within MinJobAge the controller still shows it
        assert (q.state, q.group) == ("CANCELLED", "cancelled")
        (a,) = slurm.sacct([running], duplicates=True)
        assert slurm.state_word(a.state) == "CANCELLED" and a.group == "cancelled" and a.exit_code == "0:0"
        assert slurm.parse_duration(a.elapsed) is not None and slurm.parse_time(a.end) is not None
        info = slurm.show_job(running)
        assert info is not None and info["JobState"] == "CANCELLED"


def test_a_heterogeneous_job_is_its_first_component_unless_another_is_named(recorded):
    """squeue gives each component its own JobID (the second J+1's number), sacct names them J+0 and
    J+1: asked for J, both answer the first component as J; J+1 only when named (the evaluator
    alongside the training, launcher.submit.hetjob)."""
    het = recorded["het"]
    with phase("live"):
        (q,) = slurm.squeue([het])
        assert (q.job_id, q.name, q.state, q.num_nodes) == (het, "replay-het", "PENDING", 1)
        both = {j.job_id: j for j in slurm.squeue([het, f"{het}+1"])}
        assert set(both) == {het, f"{het}+1"} and both[f"{het}+1"].reason == "JobHeldUser"
        (a,) = slurm.sacct([het], duplicates=True)
        assert (a.job_id, a.state) == (het, "PENDING")
