"""How the model is split is one typed concept (lmcore.job.parallelism): made once by the
planner, carried in plan.json, read back from a checkpoint's meta.json, and asked by everyone that
used to compare strategy names. Pure: tables, no torch."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from lmcore.job.parallelism import CheckpointFormat, DataParallel, Parallelism, trainer_problem

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("par, described, mesh, fmt, dp", [
    (Parallelism.of("ddp", 4), "ddp", "data_parallel(4)", CheckpointFormat.FULL, 4),
    (Parallelism.of("fsdp", 8, tensor=2), "fsdp x tensor_parallel(2)", "data_parallel(4) x tensor_parallel(2)",
     CheckpointFormat.DCP, 4),
    (Parallelism.of("deepspeed", 16, zero_stage=3), "deepspeed ZeRO-3", "data_parallel(16)", CheckpointFormat.ZERO, 16),
    (Parallelism.of("fsdp", 8, tensor=2, pipeline=2), "fsdp x tensor_parallel(2) x pipeline_parallel(2)",
     "data_parallel(2) x tensor_parallel(2) x pipeline_parallel(2)", CheckpointFormat.DCP, 2),
], ids=["ddp", "fsdp-tp", "zero3", "3d"])
def test_what_each_layout_says_and_how_its_checkpoint_is_laid_out(par, described, mesh, fmt, dp):
    assert (par.describe(), par.mesh(), par.checkpoint, par.data_parallel_size) == (described, mesh, fmt, dp)
    assert par.sharded_checkpoint is (fmt is not CheckpointFormat.FULL)
    assert Parallelism.from_json(json.loads(json.dumps(par.to_json()))) == par  # plan.json round trip
    assert Parallelism.of_meta({**par.meta(), "zero_stage": par.zero_stage}) == par  # a checkpoint's meta.json


def test_a_zero_stage_belongs_to_deepspeed_only_and_the_flags_follow_the_data_dimension():
    assert Parallelism.of("ddp", 2, zero_stage=2).zero_stage is None
    ddp, zero, fsdp = Parallelism.of("ddp", 2), Parallelism.of("deepspeed", 2, zero_stage=1), Parallelism.of("fsdp", 2)
    assert [(p.replicated, p.fsdp, p.zero) for p in (ddp, zero, fsdp)] == \
        [(True, False, False), (False, False, True), (False, True, False)]
    assert ddp.with_data(DataParallel.ZERO, 2) == Parallelism.of("deepspeed", 2, zero_stage=2)
    assert zero.with_data(DataParallel.SHARD) == fsdp  # the stage goes with DeepSpeed
    # how the forward computes: DeepSpeed casts the model; Lightning's mixed precision autocasts
    assert (zero.compute_mode("bf16"), ddp.compute_mode("bf16"), zero.compute_mode("fp32")) == \
        ("bf16", "autocast-bf16", "fp32")
    assert (zero.checkpoint_bytes_per_param("bf16-mixed"), zero.checkpoint_bytes_per_param("32-true"),
            fsdp.checkpoint_bytes_per_param("bf16-mixed")) == (14, 12, 12)


def test_checkpoints_of_older_lmtrain_read_as_their_layout():
    """meta.json before tensor parallelism had no tensor_parallel_size; before pipelines no
    pipeline_parallel_size: both 1."""
    old = Parallelism.of_meta({"strategy": "deepspeed", "world_size": 8, "zero_stage": 2})
    assert (old.zero, old.world_size, old.tensor, old.pipeline, old.zero_stage) == (True, 8, 1, 1, 2)
    with pytest.raises(ValueError):
        Parallelism.of_meta({"strategy": "megatron", "world_size": 8})
    with pytest.raises(KeyError):
        Parallelism.of_meta({"world_size": 8})
    now = Parallelism.of("deepspeed", 4, zero_stage=2)
    assert now.same_format(old) and not now.same_layout(old)
    assert "universal checkpoint" in now.reshard_how()
    assert not Parallelism.of("fsdp", 8).same_format(old)


def test_data_ranks_are_replicas_and_a_replicas_ranks_read_the_same_samples():
    par = Parallelism.of("fsdp", 8, tensor=2, pipeline=2)
    assert [par.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [Parallelism.of("fsdp", 4, tensor=2).data_rank(r) for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("keys, said", [
    (("ddp", 2, 1, False, False, False), "trainer.zero_stage(2) needs trainer.strategy: deepspeed (strategy is 'ddp')"),
    (("deepspeed", None, 1, False, False, False), "trainer.strategy deepspeed needs trainer.zero_stage (1, 2 or 3)"),
    (("deepspeed", 1, 1, False, True, False), "trainer.offload_optimizer needs DeepSpeed zero_stage >= 2 (zero_stage is 1)"),
    (("ddp", None, 2, False, False, False), "trainer.tensor_parallel_size(2) needs trainer.strategy: fsdp"),
    (("fsdp", None, 1, True, False, False), "it needs trainer.tensor_parallel_size >= 2 (it is 1)"),
    (("deepspeed", 2, 1, False, False, True), "trainer.offload_params needs DeepSpeed zero_stage 3 (zero_stage is 2)"),
    (("fsdp", None, 2, True, False, False), None),
])
def test_the_specs_parallelism_keys_taken_together(keys, said):
    got = trainer_problem(*keys)
    assert (got is None) if said is None else (said in got), got


# -- the concept's one owner: no other module compares strategy names -----------------------------

_NAMES = {value.value for value in DataParallel}


def _compares_a_strategy_name(node: ast.AST) -> bool:
    """``x == "ddp"``, ``"fsdp" != y``, ``s in ("ddp", "fsdp")``, ``{"deepspeed": ...}[name]``."""
    if isinstance(node, ast.Compare):
        for side in (node.left, *node.comparators):
            if isinstance(side, ast.Constant) and side.value in _NAMES:
                return True
            if isinstance(side, (ast.Tuple, ast.List, ast.Set)) and any(
                    isinstance(e, ast.Constant) and e.value in _NAMES for e in side.elts):
                return True
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value in _NAMES for k in node.value.keys)
    return False


def test_strategy_names_are_compared_only_where_the_spec_is_mapped_to_the_concept():
    owner = REPO / "src" / "lmcore" / "job" / "parallelism.py"
    found = []
    for path in sorted([*(REPO / "launcher").rglob("*.py"), *(REPO / "src").rglob("*.py")]):
        if path == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _compares_a_strategy_name(node):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")  # type: ignore[attr-defined]
    assert not found, f"ask lmcore.job.parallelism instead of comparing strategy names: {found}"
