"""Tensor and sequence parallelism (trainer.tensor_parallel_size, FSDP2 x TP):

- (tp2, tp2 with sequence parallelism and FSDP2 x TP against DDP, step by step, with the shipped
  specs' clipping: tests/unit/test_equivalence_matrix.py)
- through the real entry (lmtrain.local.launch, Lightning's ModelParallelStrategy, lmtrain's sampler and
  checkpoints): a dp2xtp2 run with sequence parallelism gives DDP's losses on the same global
  batch, then resumes elastically dp2xtp2 -> dp1xtp2 -> dp2xtp1 (FSDP2 alone) -> dp2xtp2 and
  continues the uninterrupted run's curve (DCP reshards every layout, the optimizer state comes
  along), holds the model states the memory plan said, and exports a transformers model whose
  logits equal the training ranks';
- what cannot be split is refused at validate with the arithmetic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from shared_results import shared

from launcher.planning.resolve import resolve
from launcher.submit.local_run import prepare_local_run
from lmcore.errors import SpecError
from lmtrain.checkpoint.manager import complete_checkpoints
from lmtrain.checkpoint.weights import lightning_state_dict
from tests.memory_helpers import assert_states_as_planned
from tests.unit.test_architecture_matrix import _check_export
from tests.unit.test_checkpoint_resume import _launch, _ledger, _steps

REPO = Path(__file__).resolve().parents[2]


# --- through the real entry ----------------------------------------------------------------
LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 260, "pad_token_id": 256,
         "bos_token_id": 256, "eos_token_id": 256, "tie_word_embeddings": True}
OVERRIDES = ["data.seq_len=32", "data.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.log_every_n_steps=1",
             "trainer.val_check_interval=6", "trainer.limit_val_batches=2", "checkpoint.every_n_steps=4",
             "checkpoint.keep_last=2", "optim.warmup_steps=3", "logging.tensorboard=false"]
MAX_STEPS = 12
LAYOUTS = {"dp2xtp2": (4, 2, True), "dp1xtp2": (2, 2, True), "dp2xtp1": (2, 1, False), "ddp4": (4, 1, False)}


def _spec(tmp_path: Path, config: dict | None = None, name: str = "tp") -> Path:
    """jobs/tiny-cpu-tp.yaml with a tiny Llama's ``config`` (default: LLAMA) and the repository's data."""
    spec = yaml.safe_load((REPO / "jobs" / "tiny-cpu-tp.yaml").read_text())
    spec["model"]["config"] = config or LLAMA
    spec["data"]["path"] = str(REPO / "data" / "prepared" / "tiny")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _plan(spec: Path, name: str, layout: str):
    devices, tp, sp = LAYOUTS[layout]
    strategy = ["trainer.strategy=ddp"] if layout.startswith("ddp") else ["trainer.strategy=fsdp"]
    return prepare_local_run(
        str(spec), [*OVERRIDES, *strategy, f"trainer.tensor_parallel_size={tp}", f"trainer.sequence_parallel={str(sp).lower()}"],
        devices=devices, max_steps=MAX_STEPS, name=name, environ=dict(os.environ), say=lambda *_: None,
        resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir())


@pytest.mark.slow
def test_2d_run_matches_ddp_resumes_on_every_layout_and_exports(runs_root, tmp_path):
    spec = _spec(tmp_path)

    def straight(layout: str) -> dict:
        plan = _plan(spec, f"tp-straight-{layout}", layout)
        assert _launch(plan, stop_at=0) == 0
        return {"steps": _steps(plan.paths.run_dir), "run_dir": plan.paths.run_dir}

    ddp, ref = shared("tp-straight-ddp4", lambda: straight("ddp4")), straight("dp2xtp2")
    assert sorted(ref["steps"]) == list(range(1, MAX_STEPS + 1))
    for step, (loss, norm) in ref["steps"].items():  # the same samples per step as DDP's 4 ranks
        assert loss == pytest.approx(ddp["steps"][step][0], abs=1e-5), (step, loss, ddp["steps"][step])
        assert norm == pytest.approx(ddp["steps"][step][1], rel=1e-5), (step, norm, ddp["steps"][step])
    assert_states_as_planned(ref["run_dir"])  # TP's and FSDP2's shards, as the memory plan said

    name, chain = "tp-elastic", [("dp2xtp2", 4), ("dp1xtp2", 7), ("dp2xtp1", 10), ("dp2xtp2", 0)]
    for layout, stop_at in chain:
        plan = _plan(spec, name, layout)
        assert (plan.parallelism.tensor, plan.topology.data_parallel_size) == \
            (LAYOUTS[layout][1], LAYOUTS[layout][0] // LAYOUTS[layout][1])
        assert plan.topology.grad_accum * plan.topology.data_parallel_size == 4  # the same global batch
        assert _launch(plan, stop_at=stop_at) == 0, (layout, Path(plan.paths.run_dir, "launcher.out").read_text()[-3000:])
    run_dir = plan.paths.run_dir
    starts = [(e["start_step"], e["world_size"]) for e in _ledger(run_dir) if e["event"] == "start"]
    assert starts == [(0, 4), (4, 2), (7, 2), (10, 4)], starts
    got = _steps(run_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step in range(1, MAX_STEPS + 1):
        assert got[step][0] == pytest.approx(ref["steps"][step][0], rel=1e-4), (step, got[step], ref["steps"][step])
    last = complete_checkpoints(Path(run_dir) / "checkpoints")[-1]
    assert last.step == MAX_STEPS and json.loads((Path(last.path) / "meta.json").read_text())["tensor_parallel_size"] == 2
    weights = lightning_state_dict(last.path)
    straight_weights = lightning_state_dict(complete_checkpoints(Path(ref["run_dir"]) / "checkpoints")[-1].path)
    assert weights.keys() == straight_weights.keys()
    assert max(float((weights[k] - straight_weights[k]).abs().max()) for k in weights) < 1e-4
    assert_states_as_planned(run_dir, attempts=4)

    trained = torch.load(Path(run_dir, "final-logits.pt"), weights_only=True)  # the dp2xtp2 ranks' logits
    _check_export(Path(os.environ["LMLAUNCH_RUNS_ROOT"]), run_dir, trained, tmp_path / "hf", step=MAX_STEPS)


def _validate(spec: Path, *overrides: str) -> str:
    with pytest.raises(SpecError) as err:
        resolve(str(spec), list(overrides), environ=dict(os.environ))
    return str(err.value)


def test_what_cannot_be_split_is_refused_with_the_arithmetic(tmp_path):
    spec = _spec(tmp_path)
    heads = _validate(spec, "model.config.num_attention_heads=3", "model.config.num_key_value_heads=3",
                      "model.config.hidden_size=48")
    assert "model.config.num_attention_heads(3) is not divisible by trainer.tensor_parallel_size(2)" in heads
    assert "model.config.num_key_value_heads(3) is not divisible by trainer.tensor_parallel_size(2)" in heads
    node = _validate(spec, "trainer.tensor_parallel_size=4")
    assert ("trainer.tensor_parallel_size(4) must divide the ranks of one node, tasks_per_node(2), so that each "
            "tensor-parallel group stays inside a node (it is above 2)") in node
    batch = _validate(spec, "trainer.global_batch_size=8")
    assert ("trainer.global_batch_size(8) is not a multiple of data.micro_batch_size(8) x data-parallel size(2) = "
            "world_size(4) / trainer.tensor_parallel_size(2) = 16") in batch
    seq = _validate(spec, "data.seq_len=127")
    assert "data.seq_len(127) is not divisible by trainer.tensor_parallel_size(2)" in seq
    no_plan = _validate(spec, "model.type=gpt2", "model.config={n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 260}")
    assert "model.type gpt2 has no tensor-parallel plan in transformers" in no_plan
    # transformers' plan for mixtral splits the attention only: the router and the experts would see a
    # sequence-parallel slice as a DTensor (step 0's "mixed torch.Tensor and DTensor"); plain tensor
    # parallelism keeps them whole on every rank, and the plan says so
    mixtral = ("model.type=mixtral", "model.config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64, "
               "num_attention_heads: 4, num_key_value_heads: 2, num_local_experts: 2, vocab_size: 260}")
    assert ("trainer.sequence_parallel: model.type mixtral has parameters outside its tensor-parallel plan "
            "(model.layers.*.mlp.experts, model.layers.*.mlp.gate)") in _validate(spec, *mixtral)
    notes = "\n".join(resolve(str(spec), [*mixtral, "trainer.sequence_parallel=false"], environ=dict(os.environ)).plan.notes)
    assert ("tensor parallelism keeps model.layers.*.mlp.experts, model.layers.*.mlp.gate whole on each of the 2 "
            "ranks of a tensor-parallel group") in notes
    assert "trainer.tensor_parallel_size(2) needs trainer.strategy: fsdp" in _validate(spec, "trainer.strategy=ddp")
    assert "needs trainer.tensor_parallel_size >= 2" in _validate(spec, "trainer.tensor_parallel_size=1")


def test_the_plan_shows_the_mesh_and_what_tensor_parallelism_needs_of_nccl(tmp_path):
    gpu = ["resources.gpus_per_node=8", "resources.tasks_per_node=8", "trainer.tensor_parallel_size=4",
           "trainer.global_batch_size=32", "model.config.num_key_value_heads=4", "env.vars.NCCL_P2P_DISABLE=1"]
    plan = resolve(str(_spec(tmp_path)), gpu, cluster="h100-ib", environ=dict(os.environ)).plan
    t = plan.topology
    assert (t.world_size, t.parallelism.tensor, t.data_parallel_size, t.grad_accum) == (16, 4, 4, 1)
    assert ("mesh: data_parallel(4) x tensor_parallel(4, sequence parallel, inside each node) = world_size(16); "
            "micro_batch(8) x accumulation(1) x data_parallel(4) = global_batch(32)") in t.arithmetic()
    notes = "\n".join(plan.notes)
    assert "tensor_parallel(4) runs its collectives inside each node" in notes and "NCCL_NVLS_ENABLE=1" in notes
    assert "NCCL_P2P_DISABLE=1 (set by the job spec (env.vars)): peer-to-peer between the node's GPUs is off" in notes
    # the memory plan splits the parameters over both dimensions
    assert "split over tensor_parallel(4) by the TP plan, then dim-0 shards over data_parallel(4)" in \
        plan.memory["rows"][0]["how"]
