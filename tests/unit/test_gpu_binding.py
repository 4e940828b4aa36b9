"""GPUs on SLURM, short of a GPU: the local cluster's fake GPUs (launcher.localcluster.gpus) as
slurm.conf and gres.conf declare them, the binding a GPU job asks (launcher.planning.gpus), what each
rank records and the node check at preflight (lmtrain.distributed.gpu_binding), the Trainer's devices
for a rank bound to one GPU, and GPU-hours from sacct's AllocTRES (history, the exporter, REST).
The cluster itself schedules them in tests/integration/test_gpus_on_cluster.py."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from launcher.localcluster import gpus as local_gpus
from launcher.localcluster.config import Layout, Ports, render_slurm_conf
from launcher.monitor.history_rows import build_history
from launcher.planning.resolve import resolve
from launcher.serve.exporter import gpu_hours
from lmcore.errors import SpecError
from lmcore.run.task_records import TaskRecord, write_task_record
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.records import gpus_in_tres
from lmcore.slurm.rest_job import job_description
from lmcore.slurm.rest_records import accounted
from lmtrain.distributed.gpu_binding import cuda_index, cuda_visible, gpu_used, gpus_seen, node_problems
from lmtrain.health.preflight import gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the local cluster's GPUs ------------------------------------------------------------------

@pytest.mark.parametrize(("text", "want"), [("4", ("h100", 4)), ("a100:2", ("a100", 2)), ("H100:8", ("h100", 8)),
                                            (None, None), ("none", None)])
def test_gpus_are_asked_as_a_count_with_an_optional_type(text, want):
    got = local_gpus.parse(text)
    assert (got.type, got.per_node) == want if want else got is None


@pytest.mark.parametrize("text", ["0", "17", "h100", "4:h100", "gpu:h100:4", "-1"])
def test_other_gpu_options_are_refused_with_what_is_allowed(text):
    with pytest.raises(ValueError, match=r"expected N or TYPE:N|the local cluster's nodes take 1 to 16"):
        local_gpus.parse(text)


def test_nodes_declare_their_gpus_in_slurm_conf_and_gres_conf_names_one_device_file_each(tmp_path):
    layout, gpus = Layout(tmp_path), local_gpus.parse("h100:4")
    conf = render_slurm_conf(layout, user="slurm", preempt_send_user_signal=False, ports=Ports(), node_gres=gpus.gres)
    assert "GresTypes=gpu" in conf and conf.count(" Gres=gpu:h100:4 ") == 2
    assert "AccountingStorageTRES=gres/gpu,gres/gpu:h100" in conf  # else AllocTRES says nothing of GPUs
    assert "Gres" not in render_slurm_conf(layout, user="slurm", preempt_send_user_signal=False, ports=Ports())
    gres = gpus.render_gres_conf(tmp_path, ("n1", "n2")).splitlines()
    assert "AutoDetect=off" in gres
    assert f"NodeName=n2 Name=gpu Type=h100 File={tmp_path}/gpus/n2/nvidia[0-3]" in gres


def test_the_device_files_are_character_devices_made_for_the_nodes_and_gone_with_the_cluster(tmp_path):
    made = local_gpus.make_devices(local_gpus.parse("2"), tmp_path, ("n1", "n2", "n3"))
    assert [p.relative_to(tmp_path).as_posix() for p in made] == [
        f"gpus/n{n}/nvidia{k}" for n in (1, 2, 3) for k in (0, 1)]
    for p in made:  # slurmd refuses regular files; /dev/null underneath, never a real GPU's number
        st = p.stat()
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
    # fewer nodes and GPUs: the others' files go
    kept = local_gpus.make_devices(local_gpus.parse("1"), tmp_path, ("n1",))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "gpus").rglob("*")) == [
        "gpus/n1", "gpus/n1/nvidia0"] and len(kept) == 1
    assert local_gpus.remove_devices(tmp_path) and not (tmp_path / "gpus").exists()
    assert not local_gpus.remove_devices(tmp_path)


# -- what a rank sees and records --------------------------------------------------------------

def test_a_ranks_gpus_are_what_cuda_will_show_it_never_the_batch_nodes_job_gpus():
    assert gpus_seen({"CUDA_VISIBLE_DEVICES": "2", "SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "0,1,2,3"}) == ("2",)
    assert gpus_seen({"SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "0,1"}) == ("1",)
    assert gpus_seen({"SLURM_JOB_GPUS": "0,1,2,3"}) == ()  # copied from the batch node by srun
    assert gpus_seen({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == ()
    # device cgroups: CUDA renumbers each task's GPU from 0, slurmd's index is the node's
    assert gpus_seen({"CUDA_VISIBLE_DEVICES": "0", "SLURM_STEP_GPUS": "3"}) == ("3",)
    assert cuda_visible({"CUDA_VISIBLE_DEVICES": "0", "SLURM_STEP_GPUS": "3"}) == ("0",)
    assert gpu_used(("2",), 3, "per_task:1") == "2" and cuda_index(("2",), 3) == 0
    assert gpu_used(("0", "1", "2", "3"), 3, None) == "3" and cuda_index(("0", "1", "2", "3"), 3) == 3
    assert gpu_used(("0", "1"), 0, "per_task:1") is None  # several where one was bound
    assert gpu_used(("0", "1"), 2, "closest") is None  # fewer than its local rank


def _rec(rank: int, local: int, gpus: str, gpu: str | None, node: str = "n1") -> TaskRecord:
    return TaskRecord(rank=rank, local_rank=local, node=node, pid=100 + rank, job_id="7", restart_count=0,
                      python="python", time=1.0, gpus=gpus, gpu=gpu)


def test_the_node_check_names_ranks_that_share_a_gpu_or_have_none_and_the_binding():
    ok = [_rec(0, 0, "0", "0"), _rec(1, 1, "1", "1")]
    assert node_problems(ok, bind="per_task:1", gpus_per_node=2) == []
    shared = node_problems([_rec(0, 0, "0", "0"), _rec(1, 1, "0", "0")], bind="per_task:1", gpus_per_node=2)
    assert shared == ["ranks 0 (local rank 0), 1 (local rank 1) share GPU 0 under --gpu-bind=per_task:1: each rank "
                      "needs one of its own (the profile's gpu_bind, and a gres.conf that lists each GPU once)"]
    none = node_problems([_rec(4, 0, "", None), _rec(5, 1, "0,1", None)], bind="per_task:1", gpus_per_node=2)
    assert none == ["rank 4 (local rank 0) sees GPUs none, not exactly one under --gpu-bind=per_task:1",
                    "rank 5 (local rank 1) sees GPUs 0,1, not exactly one under --gpu-bind=per_task:1"]
    unbound = node_problems([_rec(0, 0, "0", "0"), _rec(1, 1, "0", None)], bind=None, gpus_per_node=2)
    assert unbound == ["rank 1 (local rank 1) sees GPUs 0, not 2, one per local rank under no --gpu-bind "
                       "(every task sees the node's GPUs)"]


def test_preflight_reads_the_nodes_records_and_fails_the_node_whose_ranks_share_a_gpu(tmp_path, monkeypatch):
    for rec, node in ((_rec(0, 0, "0", "0"), 0), (_rec(1, 1, "0", "0"), 0), (_rec(2, 0, "0", "0", "n2"), 1)):
        write_task_record(tmp_path, rec, node=node)
    plan = SimpleNamespace(paths=SimpleNamespace(run_dir=str(tmp_path)),
                           slurm=SimpleNamespace(gpu_bind="per_task:1", gpus_per_node=2))
    env = SimpleNamespace(job_id="7", restart_count=0, launcher="slurm")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    bad = gpu_check(plan, env, "n1")
    assert not bad["ok"] and bad["message"].startswith("ranks 0 (local rank 0), 1 (local rank 1) share GPU 0")
    monkeypatch.setenv("SLURMD_NODENAME", "n2")  # the other node's one rank has its own
    assert gpu_check(plan, env, "n2") == {"name": "GPUs", "ok": True, "message": "one GPU a rank (rank 2: 0)"}


def test_a_rank_bound_to_one_gpu_gives_lightning_that_one_device_for_each_rank_of_the_node(monkeypatch):
    import torch

    from lmtrain.distributed.strategies import bound_devices

    plan = SimpleNamespace(topology=SimpleNamespace(tasks_per_node=4), trainer=SimpleNamespace(accelerator="gpu"))
    strategy = SimpleNamespace(parallel_devices=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    kwargs = bound_devices(strategy, {"devices": 4, "num_nodes": 2}, plan, None)
    assert kwargs == {"devices": 1, "num_nodes": 2}  # CUDA shows this rank one device
    assert strategy.parallel_devices == [torch.device("cuda", 0)] * 4  # parallel_devices[local_rank]: cuda:0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # every task sees the node's: Lightning's own way
    assert bound_devices(SimpleNamespace(parallel_devices=None), {"devices": 4}, plan, None) == {"devices": 4}
    cpu = SimpleNamespace(topology=plan.topology, trainer=SimpleNamespace(accelerator="cpu"))
    assert bound_devices(SimpleNamespace(parallel_devices=None), {"devices": 4}, cpu, None) == {"devices": 4}


# -- planned from the profile ------------------------------------------------------------------

def _spec(tmp_path, cluster: str, *lines: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text("\n".join([
        "name: g", f"cluster: {cluster}", "resources: {nodes: 2, time: '00:10:00'" + "".join(lines) + "}",
        "model: {type: gpt2, config: {n_layer: 1, n_head: 2, n_embd: 32, n_positions: 64, vocab_size: 260}}",
        "data: {path: /nonexistent-store, seq_len: 64, micro_batch_size: 1}",
        "trainer: {strategy: ddp, global_batch_size: 16, max_steps: 20, precision: 32-true}",
    ]) + "\n")
    return str(path)


def _profile(tmp_path, **fields: str) -> dict[str, str]:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    body = {"partitions": "{gpu: {max_time: '1:00:00'}}", "default_partition": "gpu", "gpus_per_node": "4",
            "gres_name": "gpu:h100", "runs_root": str(tmp_path / "runs"), **fields}
    (d / "g4.yaml").write_text("".join(f"{k}: {v}\n" for k, v in body.items()))
    return {"LMLAUNCH_PROFILES_DIR": str(d), "HOME": str(tmp_path)}


def test_a_gpu_spec_asks_for_one_gpu_a_task_and_on_simulated_gpus_trains_on_cpu(tmp_path):
    plan = resolve(_spec(tmp_path, "g4"), environ=_profile(tmp_path), check_data=False).plan
    s = plan.slurm
    assert (s.gres, s.gpu_bind, plan.topology.accelerator, plan.training.process_group_backend) == (
        "gpu:h100:4", "per_task:1", "gpu", "nccl")
    assert any("each task gets one GPU of its own (--gpu-bind=per_task:1) and uses it as cuda:0" in n for n in plan.notes)
    sim = resolve(_spec(tmp_path, "g4"), environ=_profile(tmp_path, gpus_simulated="true"), check_data=False).plan
    assert (sim.slurm.gres, sim.slurm.gpu_bind, sim.topology.accelerator, sim.training.process_group_backend) == (
        "gpu:h100:4", "per_task:1", "cpu", "gloo")
    assert any("simulated GPUs (gpus_simulated)" in n and "train on CPU" in n for n in sim.notes)
    unbound = resolve(_spec(tmp_path, "g4"), environ=_profile(tmp_path, gpu_bind="none"), check_data=False).plan
    assert unbound.slurm.gpu_bind is None


@pytest.mark.parametrize(("bind", "says"), [
    ("per_task:2", "gpu_bind 'per_task:2' is not one lmlaunch renders; allowed: per_task:1, single:1"),
    ("map_gpu:0,1", "map_gpu names each of the 4 GPUs of a node once")])
def test_a_binding_lmlaunch_cannot_check_is_refused_in_the_profile(tmp_path, bind, says):
    with pytest.raises(SpecError, match=says.replace("(", r"\(")):
        resolve(_spec(tmp_path, "g4"), environ=_profile(tmp_path, gpu_bind=bind), check_data=False)


def test_five_gpus_a_node_on_a_four_gpu_profile_is_refused_at_validate(tmp_path):
    with pytest.raises(SpecError, match=r"resources.gpus_per_node\(5\) is above what profile 'g4' nodes have"):
        resolve(_spec(tmp_path, "g4", ", gpus_per_node: 5"), environ=_profile(tmp_path), check_data=False)


# -- GPU-hours ---------------------------------------------------------------------------------

def test_gpu_hours_come_from_sacct_alloc_tres_in_history_and_from_the_start_lines_in_the_exporter():
    assert gpus_in_tres("billing=8,cpu=8,gres/gpu:h100=8,gres/gpu=8,node=2") == 8
    assert gpus_in_tres("cpu=2,node=2") is None and gpus_in_tres("") is None
    ledger = [{"event": "start", "attempt": 1, "job_id": "9", "time": 1000.0, "start_step": 0, "nodes": ["n1", "n2"],
               "gpus": 8},
              {"event": "startup", "attempt": 1, "process_start": 1000.0, "phases": {"first_step": 900.0}},
              {"event": "end", "attempt": 1, "time": 4600.0, "end_step": 10, "reason": "completed"}]
    beats = [{"event": "step", "attempt": 1, "step": s, "time": t} for s, t in ((1, 1900.0), (10, 4600.0))]
    unsaid = [{k: v for k, v in ledger[0].items() if k != "gpus"}, *ledger[1:]]  # a start line of before
    h = build_history("r", unsaid, beats, {"9": [(990.0, 1000.0, 4600.0, 8)]}, now=5000.0)  # sacct's AllocTRES
    assert (h.attempts[0].gpus, h.attempts[0].gpu_hours, h.attempts[0].train_gpu_hours) == (8, 8.0, 6.0)
    assert (h.gpu_hours, h.train_gpu_hours) == (8.0, 6.0) and h.to_dict()["gpu_hours"] == 8.0
    # the start line's GPUs win: a restart in place on a spare holds fewer than the allocation began with,
    # and sacct keeps the allocation's last shape
    spare = [{**ledger[0], "gpus": 12}, *ledger[1:]]
    assert build_history("r", spare, beats, {"9": [(990.0, 1000.0, 4600.0, 8)]}, now=5000.0).gpu_hours == 12.0
    cpu = build_history("r", unsaid, beats, {"9": [(990.0, 1000.0, 4600.0)]}, now=5000.0)
    assert cpu.gpu_hours is None and cpu.attempts[0].gpu_hours is None
    assert gpu_hours(ledger, running=False, now=5000.0) == (8.0, 6.0)
    assert gpu_hours([{**ledger[0], "gpus": None}, *ledger[1:]], running=False, now=5000.0) == (None, None)


def test_over_rest_the_binding_reaches_each_srun_and_the_allocation_names_its_gpus():
    batch = BatchJob("#!/bin/bash\n#SBATCH --gres=gpu:h100:4\n#SBATCH --gpu-bind=per_task:1\nsrun true\n",
                     (("gres", "gpu:h100:4"), ("gpu-bind", "per_task:1")))
    job = job_description(batch, environment={"PATH": "/bin"}, cwd="/tmp", host="login")["job"]
    assert "SLURM_GPU_BIND=per_task:1" in job["environment"] and job["tres_per_node"] == "gres/gpu:h100:4"
    rec = {"job_id": 5, "name": "g", "state": {"current": ["COMPLETED"]}, "time": {"start": 10, "end": 20, "elapsed": 10},
           "tres": {"allocated": [{"type": "cpu", "count": 8}, {"type": "gres", "name": "gpu", "count": 8},
                                  {"type": "gres", "name": "gpu:h100", "count": 8}]}}
    assert accounted(rec).alloc_tres == "cpu=8,gres/gpu=8,gres/gpu:h100=8" and accounted(rec).gpus == 8


def test_a_local_run_is_under_no_binding_and_has_every_gpu_of_the_node_unless_cuda_lists_some():
    from lmtrain.distributed.gpu_binding import binding, gpu_used, gpus_of_task

    assert binding("local", "per_task:1") is None and binding("slurm", "per_task:1") == "per_task:1"
    assert gpus_of_task({}, "local", 2) == ("0", "1")
    assert gpus_of_task({"CUDA_VISIBLE_DEVICES": "3"}, "local", 2) == ("3",)
    assert gpus_of_task({}, "slurm", 2) == ()  # under SLURM, nothing listed is none
    assert [gpu_used(("0", "1"), r, binding("local", "per_task:1")) for r in (0, 1)] == ["0", "1"]
