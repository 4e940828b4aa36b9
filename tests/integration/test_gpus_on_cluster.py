"""GPU jobs on real SLURM before a GPU is lent: a worker cluster of 3 nodes with 4 fake GPUs each
(`cluster up --gpus h100:4`: GRES on character devices, launcher/localcluster/gpus.py), its profile
read off it by `lmlaunch profile init`. SLURM allocates and binds the GPUs for real; the ranks train
on CPU behind the binding (the profile's gpus_simulated).

- A spec that leaves gpus_per_node out runs as 2 nodes x 4 GPUs and a spare node: its dry run asks
  SLURM for the GPUs and the binding; a node fails, the ranks restart in place on the spare, and the
  8 ranks reach COMPLETED each with a GPU of its own on its node (the ranks' own records); history
  gives each attempt's GPU-hours by the GPUs its start line held (the spare's included: sacct keeps
  the allocation's last shape), and a plain run's equal sacct's AllocTRES times its elapsed time.
- Two 2-GPU runs on one node get disjoint GPUs; one of them, preempted and requeued, records its
  ranks' GPUs again when it resumes.
- The torch-free scale harness (jobs/scale-sim.yaml) as a GPU job: each rank on a GPU of its own.
- Every rank sets its NCCL_IB_HCA by the GPU it got (the profile's network.hca_by_gpu): a run whose
  local rank 0 holds GPU 2 takes GPU 2's HCA.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from preempt_helpers import BASE, SPEC, ends, finish, held_at, lm, preempt, starts, submit, wait_held, wait_step
from slurm_helpers import PACE_S, REPO, faults, job_name, own_worker_cluster, pace, profile_off

from launcher.localcluster import cluster
from lmcore.run.task_records import read_task_records
from lmcore.slurm import client as slurm

pytestmark = pytest.mark.both_versions  # scripts/test.sh runs it on the other SLURM version too


@pytest.fixture(scope="module")
def gpu_cluster(slurm_cluster):
    """A worker cluster of this module's own with 4 GPUs a node; CPU-only again afterwards."""
    with own_worker_cluster("gp-", nodes=3, gpus="h100:4") as claim:
        with cluster.own_conf(claim.layout):
            nodes = slurm.nodes()
            assert len(nodes) == 3 and {n.gres.split("(")[0] for n in nodes} == {"gpu:h100:4"}, nodes
        yield claim


@pytest.fixture
def gpu_env(gpu_cluster, lm_env, tmp_path) -> dict[str, str]:
    """A profile read off the GPU cluster by `profile init`, each GPU's HCA chosen; the environment
    that uses it."""
    env = profile_off(gpu_cluster, lm_env, tmp_path / "profiles", "gpus")
    path = tmp_path / "profiles" / "gpus.yaml"
    said = path.read_text()
    for line in ("gpus_per_node: 4", 'gres_name: "gpu:h100"', "gpu_memory: 80G", "gpus_simulated: true"):
        assert line in said, said
    # the CHOOSE line of each GPU's HCA, chosen: each rank's NCCL_IB_HCA by the GPU SLURM gave it
    chosen = re.sub(r"  # hca_by_gpu: .*", "  hca_by_gpu: [mlx5_0, mlx5_1, mlx5_2, mlx5_3]", said)
    assert chosen != said, said
    path.write_text(chosen)
    return env


def _hcas_follow_the_gpus(records) -> None:
    """Each rank set the HCA of the GPU it got for itself (its record), not the one of its local rank."""
    assert all(r.rank_env == {"NCCL_IB_HCA": f"=mlx5_{r.gpu}"} for r in records), records


def _by_node(records) -> dict[str, list[tuple[int, str | None]]]:
    out: dict[str, list[tuple[int, str | None]]] = {}
    for r in records:
        out.setdefault(r.node, []).append((r.local_rank, r.gpu))
    return {node: sorted(v) for node, v in out.items()}


def test_a_spec_without_gpus_per_node_runs_8_ranks_each_on_a_gpu_of_its_own_and_a_spare_node_gets_its_gpus(
        gpu_cluster, gpu_env, tmp_path):
    spec = tmp_path / "gpu.yaml"  # the demo's spec as a GPU spec: gpus_per_node and tasks_per_node left out
    text = SPEC.read_text().replace("  gpus_per_node: 0\n", "").replace("  tasks_per_node: 1\n", "")
    spec.write_text(text.replace("../data/prepared/tiny", str(REPO / "data" / "prepared" / "tiny")))
    name = job_name("gp", "8")
    args = (spec, f"name={name}", "cluster=gpus", *BASE, "trainer.max_steps=20", "checkpoint.every_n_steps=5",
            "data.micro_batch_size=2", "resources.spare_nodes=1")
    runs = Path(gpu_env["LMLAUNCH_RUNS_ROOT"])
    with cluster.own_conf(gpu_cluster.layout):
        code, out, err = lm(gpu_env, "submit", *args, "--dry-run")
        assert code == 0, out + err
        for said in ("#SBATCH --gres=gpu:h100:4", "#SBATCH --gpu-bind=per_task:1", "#SBATCH --ntasks-per-node=4",
                     "#SBATCH --nodes=3", "resources.gpus_per_node: 4, the GPUs per node of profile 'gpus'",
                     "train on CPU"):
            assert said in out, out
        with faults(pace(PACE_S)):  # paced: the node fails while the ranks still train
            code, out, err = lm(gpu_env, "submit", *args)
        assert code == 0, out + err
        job = re.search(r"job (\d+)", out).group(1)
        wait_step(runs / name, 3, attempt=1)
        code, out, _ = lm(gpu_env, "status", name)
        assert code == 0 and "spare node(s) idle: n3" in " ".join(out.split()), out
        r = preempt(gpu_env, name, "node-failure")  # n2, the last node the ranks run on: n3 takes its place
        assert (r["node"], r.get("restarted_in_place"), r.get("left_out")) == ("n2", True, ["n2"]), r
        finish(job, runs / name)
        code, out, _ = lm(gpu_env, "history", name)
        said = " ".join(out.split())
        assert code == 0 and "n2 left out, a spare takes its place" in said and "restarted in place" in said, out
        records, problems = read_task_records(runs / name, job, 0)  # each rank's newest: after the restart
        assert not problems and len(records) == 8, (problems, records)
        # each rank its own GPU, in task order on each node, read from what SLURM set in its environment;
        # ranks 4-7 on the spare, with the spare's GPUs
        assert _by_node(records) == {n: [(k, str(k)) for k in range(4)] for n in ("n1", "n3")}, records
        assert {r.gpus for r in records} == {"0", "1", "2", "3"}  # each saw one: bound, not the node's four
        _hcas_follow_the_gpus(records)
        accounted = slurm.sacct([job])[-1]
        code, out, err = lm(gpu_env, "history", name, "--json")
    assert code == 0, out + err
    assert [(s["nodes"], s["gpus"]) for s in starts(runs / name)] == [(["n1", "n2"], 12), (["n1", "n3"], 8)]
    h = json.loads(out)  # each attempt's GPUs as its start line says: the spare's held idle in the first
    assert [a["gpus"] for a in h["attempts"]] == [12, 8] and accounted.gpus == 8, (h["attempts"], accounted)
    held = sum(a["gpus"] * a["alloc_s"] for a in h["attempts"]) / 3600  # (sacct keeps the allocation's last shape)
    assert h["gpu_hours"] == pytest.approx(held, abs=1e-5) and 0 < h["train_gpu_hours"] <= h["gpu_hours"], h


def test_two_runs_on_one_node_get_disjoint_gpus_and_a_preempted_run_records_its_gpus_again(gpu_cluster, gpu_env):
    held, other = job_name("gp", "held"), job_name("gp", "other")
    shape = ("cluster=gpus", "resources.nodes=1", "resources.gpus_per_node=2", "resources.tasks_per_node=2",
             "slurm.sbatch.nodelist=n1", "trainer.max_steps=12", "data.micro_batch_size=4")
    runs = Path(gpu_env["LMLAUNCH_RUNS_ROOT"])
    with cluster.own_conf(gpu_cluster.layout):
        job_a, dir_a = submit(gpu_env, held, *shape, holds=(held_at(3),), pace_s=None)
        wait_held(dir_a, 3, job_id=job_a)  # holding 2 of n1's GPUs while the other run starts beside it
        job_b, dir_b = submit(gpu_env, other, *shape, pace_s=None)
        finish(job_b, dir_b)
        first_a, problems_a = read_task_records(dir_a, job_a, 0)
        first_b, problems_b = read_task_records(dir_b, job_b, 0)
        assert not problems_a + problems_b and len(first_a) == len(first_b) == 2, (first_a, first_b)
        gpus_a, gpus_b = {r.gpu for r in first_a}, {r.gpu for r in first_b}
        assert {r.node for r in first_a + first_b} == {"n1"} and len(gpus_a) == len(gpus_b) == 2, (first_a, first_b)
        assert not gpus_a & gpus_b and None not in gpus_a | gpus_b, (gpus_a, gpus_b)  # never one GPU for two ranks
        _hcas_follow_the_gpus(first_a + first_b)  # one run's local rank 0 holds GPU 2 or 3, and its HCA
        assert preempt(gpu_env, held, "requeue", "--start-now")["requeued"]
        finish(job_a, dir_a)
        accounted = slurm.sacct([job_b])[-1]
        code, out, err = lm(gpu_env, "history", other, "--json")
    assert code == 0, out + err
    h = json.loads(out)  # GPU-hours as accounting has them: AllocTRES times the allocation's seconds
    assert accounted.gpus == h["attempts"][0]["gpus"] == 2, (accounted, h["attempts"])
    assert h["gpu_hours"] == pytest.approx(2 * slurm.parse_duration(accounted.elapsed) / 3600, abs=1e-5), (h, accounted)
    reasons = [e["reason"] for e in ends(dir_a)]
    # SLURM 24.11 may requeue it once more when the preemption's GraceTime runs out after `--start-now` started
    # it again: that start finds the run done and trains nothing
    assert reasons[:2] == ["preempted", "completed"] and set(reasons[2:]) <= {"completed"}, ends(dir_a)
    again, problems = read_task_records(runs / held, job_a, 1)  # the requeued start's own records
    assert not problems and sorted(r.local_rank for r in again) == [0, 1], again
    assert len({r.gpu for r in again}) == 2 and None not in {r.gpu for r in again}, again
    _hcas_follow_the_gpus(again)


def test_the_torch_free_scale_harness_runs_on_the_gpu_nodes_each_rank_on_its_gpu(gpu_cluster, gpu_env):
    """jobs/scale-sim.yaml (lmtrain.simulate: lmlaunch's per-rank machinery, no torch) as a GPU job: its
    ranks get, record and check their GPUs as a training job's do."""
    name = job_name("gp", "sim")
    with cluster.own_conf(gpu_cluster.layout):
        code, out, err = lm(gpu_env, "submit", REPO / "jobs" / "scale-sim.yaml", f"name={name}", "cluster=gpus",
                            "resources.gpus_per_node=4", "resources.tasks_per_node=4", "trainer.max_steps=20")
        assert code == 0, out + err
        job = re.search(r"job (\d+)", out).group(1)
        run_dir = Path(gpu_env["LMLAUNCH_RUNS_ROOT"]) / name
        finish(job, run_dir)
    records, problems = read_task_records(run_dir, job, 0)
    assert not problems and _by_node(records) == {n: [(k, str(k)) for k in range(4)] for n in ("n1", "n2")}, records
    _hcas_follow_the_gpus(records)
