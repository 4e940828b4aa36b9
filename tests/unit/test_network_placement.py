"""The cluster's network and a job's placement in it (lmcore.job.network, launcher.planning.placement,
the local cluster's --topology, `profile init`'s network section): pure, no SLURM."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from launcher.localcluster.topology import parse as parse_topology, version_problem
from launcher.planning.placement import group_nodes, layout_rows
from launcher.spec.profile_draft import network_lines
from lmcore.job.network import Network, Placement, Resolved, group_of_node, resolve_placement
from lmcore.job.parallelism import Parallelism
from lmcore.job.plan import Topology

BLOCKS = Network(topology="block", groups={"b1": "n[1-2]", "b2": "n[3-4]"}, block_sizes=[2, 4])
TREE = Network(topology="tree", groups={"s1": "n1,n2", "s2": "n[3-4]"})


@pytest.mark.parametrize(("placement", "net", "nodes", "span", "options"), [
    ({"within": "block"}, BLOCKS, 2, 1, {"segment": "2"}),
    ({"segment": 2}, BLOCKS, 4, 1, {"segment": "2"}),
    ({"within": "auto"}, BLOCKS, 4, 2, {"segment": "2"}),  # a pipeline over 2 nodes: segments of 2
    ({"within": "auto"}, BLOCKS, 2, 1, {"segment": "2"}),
    ({"within": "auto"}, BLOCKS, 4, 1, {}),  # whole replicas per node: nothing to keep together
    ({"within": "switch"}, TREE, 2, 1, {"switches": "1"}),
    ({"within": "switch", "max_wait": "10:00"}, TREE, 2, 1, {"switches": "1@10:00"}),
    ({"within": "auto"}, TREE, 2, 1, {"switches": "1"}),
    ({"within": "auto"}, TREE, 3, 1, {"switches": "2"}),  # larger than a switch: the fewest switches
    ({"within": "auto"}, Network(topology="tree", groups={"s1": "n[1-3]", "s2": "n[4-6]"}), 4, 2, {}),  # 2 does not divide 3
    ({}, TREE, 4, 2, {}),
    ({"within": "auto", "segment": 1}, BLOCKS, 2, 1, {"segment": "1"}),  # an explicit segment under auto: segments
    ({"within": "auto"}, Network(nvlink={"nodes_per_domain": 18}), 4, 2, {}),  # no topology: nothing SLURM can do
])
def test_a_placement_becomes_the_sbatch_options_that_ask_slurm_for_it(placement, net, nodes, span, options):
    got = resolve_placement(Placement(**placement), net, nodes, group_nodes=span)
    assert isinstance(got, Resolved), got
    assert got.options == options


@pytest.mark.parametrize(("placement", "net", "nodes", "words"), [
    ({"within": "block"}, BLOCKS, 4, ["4 nodes never fit in one block", "b1, has 2"]),
    ({"within": "switch"}, TREE, 3, ["3 nodes never fit in one switch", "has 2"]),
    ({"segment": 4}, BLOCKS, 4, ["segment(4) is larger than the base block (2 nodes)"]),
    ({"segment": 2}, BLOCKS, 3, ["segment(2) must divide the job's 3 nodes"]),
    ({"segment": 2}, TREE, 2, ["segment(2) needs a topology/block cluster", "topology tree"]),
    ({"within": "block"}, TREE, 2, ["within: block needs topology/block", "use within: switch"]),
    ({"within": "switch"}, BLOCKS, 2, ["within: switch needs topology/tree", "use within: block"]),
    ({"within": "switch"}, Network(), 2, ["needs the cluster's topology", "profile init"]),
    ({"within": "block", "segment": 2}, BLOCKS, 2, ["give one of the two"]),
    ({"within": "nvlink"}, TREE, 2, ["needs network.nvlink"]),
    ({"within": "nvlink"}, Network(topology="tree", groups={"s1": "n[1-4]"}, nvlink={"nodes_per_domain": 4}), 2,
     ["needs topology/block whose blocks are the NVLink domains", "topology tree"]),
    ({"within": "nvlink"}, Network(topology="block", groups={"b1": "n[1-4]", "b2": "n[5-8]"},
                                   nvlink={"nodes_per_domain": 8, "domains": {"d1": "n[1-8]"}}), 2,
     ["network.nvlink.domains d1 of profile 'x' are not blocks"]),
    ({"within": "nvlink"}, Network(topology="block", groups={"b1": "n[1-4]"}, nvlink={"nodes_per_domain": 8}), 6,
     ["6 nodes are more than the base block", "(4 nodes)"]),
    ({"within": "nvlink", "segment": 2}, Network(topology="block", groups={"b1": "n[1-4]"}, nvlink={"nodes_per_domain": 4}),
     4, ["give one of the two"]),
])
def test_a_placement_that_can_never_be_satisfied_is_refused_naming_the_key_and_the_numbers(placement, net, nodes, words):
    got = resolve_placement(Placement(**placement), net, nodes, group_nodes=1, profile="profile 'x'")
    assert isinstance(got, str), got
    for w in words:
        assert w in got, got


def test_nvlink_domains_are_asked_for_through_the_blocks_that_hold_them():
    net = Network(topology="block", groups={"r1": "n[1-18]", "r2": "n[19-36]"}, nvlink={"nodes_per_domain": 18})
    got = resolve_placement(Placement(within="nvlink"), net, 16)
    assert isinstance(got, Resolved) and got.options == {"segment": "16"}
    assert "never fit in one NVLink domain" in str(resolve_placement(Placement(within="nvlink"), net, 19))


@pytest.mark.parametrize(("network", "words"), [
    ({"topology": "block"}, "needs its groups"),
    ({"groups": {"s1": "n1"}}, "topology is none"),
    ({"topology": "tree", "groups": {"s1": "n[1-2]", "s2": "n2"}}, "node n2 is in both s1 and s2"),
    ({"topology": "block", "groups": {"b1": "n[1-2]"}, "block_sizes": [2, 6]}, "power of two"),
    ({"topology": "block", "groups": {"b1": "n[1-2]"}, "block_sizes": [0, 4]}, "a block holds at least one node"),
    ({"hca_by_gpu": ["=mlx5_0"]}, "not an HCA name"),
    ({"topology": "tree", "groups": {"s1": "n[1-2]"}, "block_sizes": [2]}, "belong to topology: block"),
    ({"topology": "tree", "groups": {"s1": "n[1-"}}, "not a SLURM hostlist"),
    ({"hca_by_gpu": ["mlx5_0", "bad name"]}, "not an HCA name"),
])
def test_a_profile_network_that_cannot_be_right_is_refused(network, words):
    with pytest.raises(ValidationError, match=words):
        Network(**network)


def test_a_nodes_group_and_the_units_that_cross_groups():
    from lmcore.job.network import crossing_units

    assert crossing_units(["n1", "n2", "n3", "n9"], {"n1": "b1", "n2": "b1", "n3": "b2"}, 2) == [["n3", "n9"]]
    assert group_of_node({"b1": "n[1-2]"}, "n2") == "b1" and group_of_node({"b1": "n[1-2]"}, "n3") is None


def _topo(nodes: int, tpn: int, *, pipeline: int = 1, tensor: int = 1) -> Topology:
    world = nodes * tpn
    par = Parallelism.of("fsdp", world, tensor=tensor, pipeline=pipeline)
    return Topology(nodes=nodes, tasks_per_node=tpn, world_size=world, accelerator="cpu", micro_batch_size=1,
                    grad_accum=1, global_batch_size=world, parallelism=par)


def test_the_rank_layout_keeps_a_pipeline_inside_a_segment_and_crosses_with_the_data_dimension():
    topo = _topo(4, 1, pipeline=2)
    assert group_nodes(topo) == 2
    rows = layout_rows(topo, 2)
    assert [(r["stages"], r["replicas"], r["segment"]) for r in rows] == [
        ([0], [0], 0), ([1], [0], 0), ([0], [1], 1), ([1], [1], 1)]
    assert group_nodes(_topo(2, 4, pipeline=2, tensor=2)) == 1  # tp2 x pp2 inside one 4-task node
    assert group_nodes(_topo(4, 2, pipeline=2, tensor=2)) == 2
    assert group_nodes(_topo(3, 4, pipeline=3)) == 3  # pipelines of 3 on nodes of 4: ranks 3-5 straddle nodes 0 and 1
    assert group_nodes(_topo(6, 4, pipeline=3, tensor=2)) == 3


@pytest.mark.parametrize(("text", "nodes", "want"), [
    ("tree:2x2", None, ("tree", 2, 2)), ("block:2", 8, ("block", 4, 2)), ("block:2x4", 8, ("block", 2, 4)),
    ("none", 4, None),
])
def test_the_local_clusters_topology_option(text, nodes, want):
    topo = parse_topology(text, nodes)
    assert (None if topo is None else (topo.kind, topo.groups, topo.per_group)) == want


@pytest.mark.parametrize(("text", "nodes", "words"), [
    ("tree:3", 4, "do not cut into groups of 3"), ("ring:2", 4, "expected tree:GxN"),
    ("tree:2x2", 3, "has 4 nodes but --nodes is 3"), ("block:2", None, "say the groups"),
])
def test_a_topology_option_that_does_not_fit_the_nodes_is_refused(text, nodes, words):
    with pytest.raises(ValueError, match=words):
        parse_topology(text, nodes)


def test_a_topology_larger_than_the_local_cluster_is_refused_naming_the_option():
    from launcher.localcluster.cluster import _wanted_topology
    from launcher.localcluster.config import Settings
    from lmcore.errors import UserError

    with pytest.raises(UserError, match="--topology tree:9x8: 72 nodes; the local cluster runs 1 to 64"):
        _wanted_topology("tree:9x8", Settings(), Settings().ports, None)


def test_a_topology_sets_the_node_count_whatever_the_ports_given_or_kept_say():
    """CI's case: the state kept 8 nodes, the claim gave its 2 nodes' ports and asked block:4x2;
    the topology's 8 nodes win, or topology.conf names nodes that slurm.conf lacks."""
    from launcher.localcluster.cluster import _wanted_topology
    from launcher.localcluster.config import Ports, Settings

    kept = Settings(ports=Ports.for_slot(0, None).with_nodes(8), topology="block:4x2")
    two = Ports.for_slot(0, None)
    topo, nodes = _wanted_topology("block:4x2", kept, two, None)
    assert topo is not None and (topo.nodes, nodes) == (8, 8)
    assert _wanted_topology("none", kept, two, None) == (None, None)  # no topology: the ports' own count
    topo, nodes = _wanted_topology(None, kept, kept.ports, None)  # kept as it was: nothing to change
    assert topo is not None and nodes is None


def test_the_local_topology_conf_is_what_topology_conf_5_describes():
    tree = parse_topology("tree:2x2", None)
    assert tree is not None and tree.render(("n1", "n2", "n3", "n4")).splitlines()[1:] == [
        "SwitchName=s1 Nodes=n[1-2]", "SwitchName=s2 Nodes=n[3-4]", "SwitchName=top Switches=s1,s2"]
    block = parse_topology("block:2", 8)
    assert block is not None and block.render(tuple(f"n{i}" for i in range(1, 9))).splitlines()[-1] == "BlockSizes=2,4,8"
    assert "SLURM 22.05 has no topology/block plugin (of the tested releases, 24.11, 26.05 have it)" in str(
        version_problem(block, "22.05"))
    assert version_problem(block, "24.11") is None and version_problem(tree, "22.05") is None  # type: ignore[arg-type]


# `scontrol show topology` as SLURM 24.11 (topology/block) and 22.05 (topology/tree) print it here
BLOCK_RECORDS = [
    {"BlockName": "b1", "BlockIndex": "0", "Nodes": "n1,n2", "BlockSize": "2"},
    {"BlockName": "b2", "BlockIndex": "1", "Nodes": "n3,n4", "BlockSize": "2"},
    {"AggregatedBlock": "b[1-2]", "BlockIndex": "2", "Nodes": "n[1-4]", "BlockSize": "4"},
]
TREE_RECORDS = [
    {"SwitchName": "s1", "Level": "0", "LinkSpeed": "1", "Nodes": "n1,n2"},
    {"SwitchName": "s2", "Level": "0", "LinkSpeed": "1", "Nodes": "n3,n4"},
    {"SwitchName": "top", "Level": "1", "LinkSpeed": "1", "Nodes": "n[1-4]", "Switches": "s1,s2"},
]


@pytest.mark.parametrize(("plugin", "records", "want"), [
    ("topology/block", BLOCK_RECORDS, {"topology": "block", "groups": {"b1": "n1,n2", "b2": "n3,n4"}, "block_sizes": [2, 4]}),
    ("topology/tree", TREE_RECORDS, {"topology": "tree", "groups": {"s1": "n1,n2", "s2": "n3,n4"}}),
    ("topology/none", [], {"topology": "none"}),
    ("topology/tree", [], {"topology": "none"}),
])
def test_profile_init_writes_the_topology_slurm_reports(plugin, records, want):
    section = yaml.safe_load("\n".join(network_lines(plugin, records)))["network"]
    assert section == want
    Network(**section)  # what it wrote loads


def test_status_shows_each_node_of_the_running_attempt_with_its_group_and_ranks():
    from launcher.monitor.status_rows import layout_of

    ledger = [{"event": "start", "nodes": ["n5", "n6"], "world_size": 4, "groups": {"n5": "b3", "n6": "b3"}}]
    assert layout_of(ledger) == [{"node": "n5", "group": "b3", "ranks": [0, 1]}, {"node": "n6", "group": "b3", "ranks": [2, 3]}]
    assert layout_of([{"event": "start", "nodes": ["n1"], "world_size": 1}]) == [{"node": "n1", "group": None, "ranks": [0, 0]}]
    assert layout_of([]) is None


def _gpu_profile(tmp_path, network: str) -> dict[str, str]:
    """The shipped H100 profile with a network section (and without its all-HCA NCCL_IB_HCA)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "cluster_profiles" / "h100-ib.yaml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("NCCL_IB_HCA:"))
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "gpus.yaml").write_text(text + "\n" + network)
    return {"LMLAUNCH_PROFILES_DIR": str(tmp_path), "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}


def _dry_run(environ: dict[str, str], *overrides: str) -> tuple[int, str, str]:
    import io
    from pathlib import Path

    from launcher.cli import main
    from launcher.context import Context

    spec = Path(__file__).resolve().parents[2] / "jobs" / "tiny-cpu.yaml"
    out, err = io.StringIO(), io.StringIO()
    code = main(["submit", str(spec), "cluster=gpus", "resources.gpus_per_node=8", "resources.tasks_per_node=null",
                 "trainer.global_batch_size=128", *overrides, "--dry-run"], Context(stdout=out, stderr=err, environ=environ))
    return code, out.getvalue(), err.getvalue()


def test_each_gpu_rank_gets_the_hca_nearest_its_gpu_and_one_nvlink_domain_gets_mnnvl(tmp_path):
    hcas = ", ".join(f"mlx5_{i}" for i in range(8))
    environ = _gpu_profile(tmp_path, f"network:\n  topology: block\n  groups: {{r1: \"gpu[1-18]\", r2: \"gpu[19-36]\"}}\n"
                                     f"  nvlink: {{nodes_per_domain: 18}}\n  hca_by_gpu: [{hcas}]\n")
    code, out, err = _dry_run(environ, "resources.placement.within=nvlink")
    assert code == 0, err
    assert "NCCL_IB_HCA=<by the GPU on its node: 0: =mlx5_0, 1: =mlx5_1, 2: =mlx5_2" in out and "7: =mlx5_7>" in out, out
    assert "NCCL_MNNVL_ENABLE=1    # the job's nodes are one NVLink domain" in out, out
    assert "#SBATCH --segment=2" in out, out
    # the job's own env.vars win over the network's, said
    code, out, err = _dry_run(environ, "resources.placement.within=nvlink", "env.vars={NCCL_MNNVL_ENABLE: '0'}")
    assert code == 0 and "NCCL_MNNVL_ENABLE=0" in out and "not the network's 1" in out, out + err
    # a profile that says nothing of its network sets nothing
    code, out, err = _dry_run(_gpu_profile(tmp_path / "plain", ""))
    assert code == 0 and "NCCL_MNNVL_ENABLE" not in out and "by the GPU on its node" not in out, out + err


def test_a_rank_sets_its_own_value_before_nccl_starts():
    from lmtrain.distributed.task_env import apply_rank_env

    env: dict[str, str] = {}
    assert apply_rank_env({"NCCL_IB_HCA": {"by_local_rank": ["=mlx5_0", "=mlx5_1"], "why": ""}}, 1, env) == {
        "NCCL_IB_HCA": "=mlx5_1"}
    assert env == {"NCCL_IB_HCA": "=mlx5_1"}
    # by the GPU SLURM gave the rank: a second job's local rank 0 on GPU 2 takes GPU 2's HCA
    hcas = {"NCCL_IB_HCA": {"by_gpu": [f"=mlx5_{i}" for i in range(4)], "by_local_rank": ["=mlx5_0", "=mlx5_1"]}}
    assert apply_rank_env(hcas, 0, {}, gpu="2") == {"NCCL_IB_HCA": "=mlx5_2"}
    assert apply_rank_env(hcas, 1, {}, gpu=None) == {"NCCL_IB_HCA": "=mlx5_1"}  # a rank that cannot tell its GPU
    assert apply_rank_env(hcas, 1, {}, gpu="7") == {"NCCL_IB_HCA": "=mlx5_1"}  # an index the profile does not name


@pytest.mark.parametrize(("network", "env_line", "words"), [
    ("network:\n  hca_by_gpu: [mlx5_0, mlx5_1]\n", "", "names 2 HCA(s) for 8 GPUs per node"),
    ("network:\n  hca_by_gpu: [" + ", ".join(f"mlx5_{i}" for i in range(8)) + "]\n",
     "  NCCL_IB_HCA: {value: mlx5_0, why: all}\n", "both set NCCL_IB_HCA"),
])
def test_a_profile_whose_hcas_do_not_match_its_gpus_is_refused(tmp_path, network, env_line, words):
    environ = _gpu_profile(tmp_path, network)
    if env_line:
        text = (tmp_path / "gpus.yaml").read_text().replace("env:\n", "env:\n" + env_line, 1)
        (tmp_path / "gpus.yaml").write_text(text)
    code, out, err = _dry_run(environ)
    assert code == 4 and words in err, out + err
