"""A cluster profile read off a cluster's scontrol records (launcher.spec.profile_draft): the
records below are the shapes SLURM prints (a GPU cluster with typed GRES, an UNLIMITED partition, a
DOWN one, QOS preemption, no accounting, a short MinJobAge); every draft loads as a valid profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.spec.profile_draft import UNLIMITED_TIME, ClusterFacts, draft, partitions
from launcher.spec.profiles import load_profile_file


def _part(name: str, **kv: str) -> dict[str, str]:
    base = {"PartitionName": name, "Default": "NO", "MaxTime": "2-00:00:00", "PriorityTier": "1", "PreemptMode": "OFF",
            "GraceTime": "0", "State": "UP", "Nodes": "gpu[01-04]"}
    return {**base, **kv}


def _node(name: str, **kv: str) -> dict[str, str]:
    base = {"NodeName": name, "CPUTot": "96", "RealMemory": "1024000", "Gres": "gpu:h100:8(S:0-1)",
            "NodeAddr": f"10.0.0.{name[-1]}"}
    return {**base, **kv}


GPU_CLUSTER = ClusterFacts(
    partitions=[
        _part("batch", Default="YES", MaxTime="UNLIMITED", PriorityTier="1", PreemptMode="REQUEUE", GraceTime="120"),
        _part("urgent", MaxTime="12:00:00", PriorityTier="10"),
        _part("old", State="DOWN", MaxTime="1:00:00", Nodes="old[1-2]"),
    ],
    nodes=[_node(f"gpu0{i}") for i in range(1, 4)] + [_node("gpu04", Gres="gpu:h100:4(S:0)")],
    config={"SLURM_VERSION": "24.11.5", "ClusterName": "big", "PreemptType": "preempt/partition_prio",
            "PreemptMode": "REQUEUE", "SlurmctldParameters": "enable_configless,preempt_send_user_signal",
            "MinJobAge": "2 sec"},
    default_account="proj42",
)


def _load(tmp_path: Path, name: str, text: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return load_profile_file(path)


def test_a_gpu_cluster_is_read_into_a_profile_that_validates(tmp_path):
    text = draft("big", GPU_CLUSTER, when="2026-11-25")
    p = _load(tmp_path, "big", text)
    assert sorted(p.partitions) == ["batch", "old", "urgent"]
    assert p.partitions["batch"].max_time == UNLIMITED_TIME and p.partitions["batch"].preemptible
    assert p.partitions["batch"].grace_seconds == 120
    assert not p.partitions["urgent"].preemptible and p.partitions["urgent"].max_time == "12:00:00"
    assert (p.default_partition, p.preemptible_partition, p.high_priority_partition) == ("batch", "batch", "urgent")
    assert (p.gpus_per_node, p.gres_name, p.cpus_per_gpu, p.mem_per_gpu) == (8, "gpu:h100", 12, "125G")  # 1,024,000 MB / 8
    assert p.mem_per_node == "1000G" and "the smallest RealMemory of the nodes of 'batch'" in text  # 1,024,000 MB
    assert p.account == "proj42" and p.sends_user_signal_on_preemption and p.max_tasks_per_node == 8
    assert p.env == {}  # the fabric's variables are the user's to choose
    assert "MaxTime=UNLIMITED: no limit; written as a year" in text
    assert "Gres of 3 of the 4 nodes of 'batch'" in text  # the most common GPU count
    assert "old: {max_time: \"01:00:00\"}  # MaxTime=1:00:00, PriorityTier=1, nodes old[1-2], DOWN or INACTIVE now" in text
    assert "# CHOOSE: a directory every node sees" in text and "NCCL_SOCKET_IFNAME" in text
    assert "MinJobAge=2 sec: finished jobs leave squeue within a minute" in text
    assert p.slurm_version == "24.11.5" and "# NOTE: SLURM" not in text  # a tested release: nothing to say
    # SLURM does not know a GPU's memory; the type in Gres does, for one sold in one size
    assert p.gpu_memory == "80G" and "one h100's memory (the GPU type in Gres)" in text
    assert not p.gpus_simulated  # nodes on the fabric, not this machine


@pytest.mark.parametrize(("gres", "memory"), [
    ("gpu:a100_80g:8", "80G"), ("gpu:A100-40GB:8", "40G"), ("gpu:h200:8", "141G"), ("gpu:a100:8", None),
    ("gpu:8", None), ("gpu:tesla:8", None)])
def test_the_gpu_memory_comes_from_the_type_or_is_left_to_choose(tmp_path, gres, memory):
    facts = ClusterFacts(partitions=[_part("p", Default="YES", Nodes="g[1-2]")],
                         nodes=[_node("g1", Gres=gres), _node("g2", Gres=gres)], config={"SLURM_VERSION": "24.11.5"})
    text = draft("t", facts, when="2026-12-02")
    assert _load(tmp_path, "t", text).gpu_memory == memory
    if memory is None:  # what validate explains: set it, or the memory fit is not made
        assert "# gpu_memory: 80G  # CHOOSE: one GPU's memory" in text, text


@pytest.mark.parametrize(("addr", "nvidia", "simulated"), [("127.0.0.1", False, True), ("127.0.0.1", True, False),
                                                           ("10.0.0.1", False, False)])
def test_gpus_on_nodes_that_are_this_machine_without_a_gpu_are_simulated(tmp_path, addr, nvidia, simulated):
    facts = ClusterFacts(partitions=[_part("p", Default="YES", Nodes="n[1-2]")],
                         nodes=[_node("n1", NodeAddr=addr, Gres="gpu:h100:4"), _node("n2", NodeAddr=addr, Gres="gpu:h100:4")],
                         config={"SLURM_VERSION": "22.05.8"}, nvidia_here=nvidia)
    assert _load(tmp_path, "s", draft("s", facts, when="2026-12-02")).gpus_simulated is simulated


def test_qos_preemption_no_accounting_and_a_cpu_cluster(tmp_path):
    facts = ClusterFacts(
        partitions=[_part("cpu", Default="YES", PreemptMode="CANCEL", GraceTime="60", Nodes="c[1-2]")],
        nodes=[_node("c1", Gres="(null)", CPUTot="64", NodeAddr="127.0.0.1"),
               _node("c2", Gres="(null)", CPUTot="32", NodeAddr="127.0.0.1")],
        config={"PreemptType": "preempt/qos", "PreemptMode": "CANCEL", "SlurmctldParameters": "(null)"},
        accounting=False, problems=["accounting does not answer (sacct: error: slurmdbd: ...)"],
    )
    text = draft("cpus", facts, when="2026-11-25")
    p = _load(tmp_path, "cpus", text)
    assert p.partitions["cpu"].preemptible and p.partitions["cpu"].grace_seconds == 60
    assert p.high_priority_partition is None and p.account is None
    assert (p.gpus_per_node, p.max_tasks_per_node, p.cpus_per_gpu) == (0, 32, 1)
    assert p.env["GLOO_SOCKET_IFNAME"].value == "lo"  # every node on loopback, as the local cluster's
    assert "# NOTE: accounting does not answer" in text and "sacct does not answer here" in text
    assert "# account: CHOOSE  # no DefaultAccount was found (no accounting)" in text
    assert p.slurm_version is None and "# slurm_version: not read" in text


def test_without_preemption_no_partition_is_preemptible():
    facts = ClusterFacts(partitions=[_part("a", Default="YES"), _part("b", PriorityTier="5")], nodes=[],
                         config={"PreemptType": "preempt/none"})
    assert [p.preemptible for p in partitions(facts)] == [False, False]
    assert "# no preemptible partition: PreemptType=preempt/none" in draft("x", facts, when="d")


def test_a_cluster_without_partitions_cannot_be_drafted():
    with pytest.raises(ValueError, match="no partition"):
        draft("x", ClusterFacts(partitions=[], nodes=[], config={}), when="d")


def test_doctor_names_where_a_profile_disagrees_with_the_live_cluster(tmp_path):
    from launcher.doctor.checks import OK, WARN, judge_profile

    agreeing = _load(tmp_path, "big", draft("big", GPU_CLUSTER, when="2026-11-25"))
    assert judge_profile(agreeing, GPU_CLUSTER).status == OK
    text = (draft("big", GPU_CLUSTER, when="2026-11-25")
            .replace('urgent: {max_time: "12:00:00"}', 'urgent: {max_time: "1-00:00:00", preemptible: true, grace_seconds: 5}')
            .replace("default_partition: batch", "default_partition: urgent")
            .replace("gpus_per_node: 8", "gpus_per_node: 16")
            .replace("partitions:\n", "partitions:\n  gone: {max_time: \"1:00:00\"}\n"))
    (tmp_path / "edited").mkdir()
    check = judge_profile(_load(tmp_path / "edited", "big", text), GPU_CLUSTER)
    assert check.status == WARN
    assert check.figures["differences"] == [
        "partition 'gone' does not exist",
        "'urgent' max_time 1-00:00:00 is above its MaxTime 12:00:00",
        "'urgent' preemptible: true, but the cluster cannot preempt it",
        "default_partition urgent, the cluster's default is batch",
        "gpus_per_node 16, the nodes have 4, 8",
    ]


def test_doctor_names_where_a_profiles_network_is_not_the_clusters_topology(tmp_path):
    import dataclasses

    from launcher.doctor.checks import OK, WARN, judge_profile

    records = [{"BlockName": "b1", "Nodes": "n[1-2]", "BlockSize": "2"}, {"BlockName": "b2", "Nodes": "n[3-4]", "BlockSize": "2"},
               {"AggregatedBlock": "b[1-2]", "Nodes": "n[1-4]", "BlockSize": "4"}]
    live = dataclasses.replace(GPU_CLUSTER, config={**GPU_CLUSTER.config, "TopologyPlugin": "topology/block"},
                               topology=records)
    text = draft("big", live, when="2026-11-28")
    assert judge_profile(_load(tmp_path, "big", text), live).status == OK  # what profile init wrote agrees
    (tmp_path / "edited").mkdir()
    edited = text.replace('"b2": "n[3-4]"', '"b2": "n[3-5]"').replace("block_sizes: [2, 4]", "block_sizes: [2, 8]")
    check = judge_profile(_load(tmp_path / "edited", "big", edited), live)
    assert check.status == WARN and check.figures["differences"] == [
        "network.groups b2: 'n[3-5]', the cluster's b2 has n[3-4]", "network.block_sizes [2, 8], the cluster's [2, 4]"]
    (tmp_path / "tree").mkdir()
    check = judge_profile(_load(tmp_path / "tree", "big", text), dataclasses.replace(live, config=GPU_CLUSTER.config))
    assert check.figures["differences"] == ["network.topology block, the cluster's TopologyPlugin is topology/none"]


def test_a_release_lmlaunch_was_never_tested_on_is_recorded_with_the_nearest_tested_one(tmp_path):
    from lmcore.slurm import versions

    facts = ClusterFacts(partitions=GPU_CLUSTER.partitions, nodes=GPU_CLUSTER.nodes,
                         config={**GPU_CLUSTER.config, "SLURM_VERSION": "25.11.2"})
    text = draft("newer", facts, when="2026-11-29")
    assert _load(tmp_path, "newer", text).slurm_version == "25.11.2"
    assert "# NOTE: SLURM 25.11.2 is not a release lmlaunch was tested on (22.05, 24.11, 26.05); the nearest tested " \
           "is 26.05" in text
    assert [versions.nearest_tested(v) for v in ("23.02.7", "23.11.1", "25.05.3", "27.11.0", "21.08.8")] == \
        ["22.05", "24.11", "24.11", "26.05", "22.05"]
    assert versions.is_tested("26.05.5") and versions.is_tested("22.05.8") and not versions.is_tested("25.05.0")
    assert versions.untested_note("26.05.5") is None and "could not be read" in versions.untested_note("weird")


def test_doctor_says_when_the_live_release_differs_from_the_profiles_or_was_never_tested(tmp_path):
    from launcher.doctor.version_check import version_problems

    p = _load(tmp_path, "big", draft("big", GPU_CLUSTER, when="2026-11-25"))
    assert version_problems(p, {"SLURM_VERSION": "24.11.6"}) == []  # a point release: the same release
    (moved,) = version_problems(p, {"SLURM_VERSION": "26.05.5"})
    assert moved == "profile 'big' was read off SLURM 24.11.5, the cluster now runs 26.05.5 (`lmlaunch profile init` reads it again)"
    assert len(version_problems(p, {"SLURM_VERSION": "25.05.1"})) == 2
