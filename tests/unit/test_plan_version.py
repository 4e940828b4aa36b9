"""plan.json carries its version: a requeued attempt reads the plan its submission wrote, so an
older version is read as it was meant and any other is refused with a message saying what to do."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.planning.resolve import resolve
from lmcore.job.plan import PLAN_VERSION, LaunchPlan, PlanVersionError


def _plan(repo, *overrides: str, job: str = "tiny-cpu.yaml") -> LaunchPlan:
    environ = {"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/home/u", "USER": "u"}
    return resolve(str(repo / "jobs" / job), list(overrides), cluster="local", environ=environ).plan


def _as_version_2(plan: LaunchPlan) -> dict:
    """The plan.json an lmlaunch of plan version 2 wrote: the strategy in ``training``, the
    tensor-parallel size and sequence parallelism in ``topology``."""
    d = json.loads(plan.to_json())
    par = d["topology"].pop("parallelism")
    d["training"]["strategy"] = par["strategy"]
    d["topology"].update(tensor_parallel_size=par["tensor"], sequence_parallel=par["sequence_parallel"])
    d["version"] = 2
    return d


def _as_version_1(plan: LaunchPlan) -> dict:
    """The plan.json an lmlaunch of plan version 1 wrote: the spec's trainer settings in one dict,
    the Trainer's arguments derived by the entry."""
    d = _as_version_2(plan)
    t, tr = d.pop("trainer"), d.pop("training")
    spec_t = d["spec"]["trainer"]
    d["trainer"] = {
        "accelerator": t["accelerator"], "devices": t["devices"], "num_nodes": t["num_nodes"],
        "strategy": tr["strategy"], "process_group_backend": tr["process_group_backend"],
        "precision": t["precision"], "max_steps": t["max_steps"],
        "accumulate_grad_batches": t["accumulate_grad_batches"], "gradient_clip_val": tr["gradient_clip_val"],
        "val_check_interval": spec_t["val_check_interval"], "limit_val_batches": spec_t["limit_val_batches"],
        "log_every_n_steps": t["log_every_n_steps"], "use_distributed_sampler": False,
        "enable_checkpointing": False, "seed": tr["seed"],
    }
    d["version"] = 1
    return d


@pytest.mark.parametrize("overrides", [
    (),
    ("trainer.val_check_interval=null",),
    ("trainer.limit_val_batches=0",),
    ("trainer.global_batch_size=64", "trainer.strategy=deepspeed", "trainer.zero_stage=2"),
], ids=["default", "validate-at-end", "no-validation", "accumulation-deepspeed"])
def test_a_version_1_plan_reads_as_the_same_plan(repo, overrides):
    plan = _plan(repo, *overrides)
    assert plan.version == PLAN_VERSION
    old = LaunchPlan.from_dict(_as_version_1(plan))
    assert old == plan
    assert dataclasses.asdict(old.trainer) == plan.trainer.kwargs()


@pytest.mark.parametrize("job, overrides", [
    ("tiny-cpu.yaml", ()),
    ("tiny-cpu.yaml", ("trainer.global_batch_size=64", "trainer.strategy=deepspeed", "trainer.zero_stage=3")),
    ("tiny-cpu-tp.yaml", ()),
], ids=["ddp", "zero3", "fsdp-tp2-sp"])
def test_a_version_2_plan_reads_as_the_same_parallelism(repo, job, overrides):
    """Version 2 named the strategy and the tensor-parallel size in two places; version 3 has one
    typed record of how the model is split (lmcore.job.parallelism), made from them."""
    plan = _plan(repo, *overrides, job=job)
    assert plan.parallelism.tensor == (2 if job == "tiny-cpu-tp.yaml" else 1)
    old = LaunchPlan.from_dict(_as_version_2(plan))
    assert old == plan
    assert old.parallelism == plan.parallelism and old.parallelism.zero_stage == plan.job_spec().trainer.zero_stage


@pytest.mark.parametrize("version", [PLAN_VERSION + 1, 0, None, "2"])
def test_an_unknown_plan_version_is_refused_with_what_to_do(repo, version):
    d = json.loads(_plan(repo).to_json())
    if version is None:
        del d["version"]
    else:
        d["version"] = version
    with pytest.raises(PlanVersionError) as err:
        LaunchPlan.from_dict(d)
    msg = str(err.value)
    assert f"plan version {version!r}" in msg and "reads plan versions 1, 2, 3" in msg
    assert "lmlaunch submit SPEC --new" in msg
    if version == PLAN_VERSION + 1:
        assert "a newer lmlaunch" in msg


def test_the_plan_round_trips_through_plan_json(repo):
    plan = _plan(repo, "trainer.strategy=fsdp")
    assert LaunchPlan.from_dict(json.loads(plan.to_json())) == plan
