"""Every way to scale trains the model DDP trains (tests/equivalence.py, the harness and its
tolerances): the same tied GPT-2 and untied Llama, on the same data, with the shipped specs'
clipping (hit in every compared step), accumulation, weight decay, warmup and cosine, through the
real entry, as FSDP2, ZeRO 1-3, tensor parallel (with and without sequence parallelism), 2
pipeline stages under each schedule, FSDP2 x TP, TP x PP and FSDP2 x PP: the loss and gradient
norm of each of 8 steps and the final weights (read as export reads them) against DDP on 2 ranks,
and each rank's model states as the memory plan said. GPT-2 has no tensor-parallel plan: its TP
cells are refused by the planner, naming why. The slow cells (more architectures, bf16 autocast)
are bench/equivalence.py's.

A run checkpointed under one strategy and resumed under another (ZeRO-3 -> DDP -> 2 pipeline
stages; ZeRO-2 -> TP with sequence parallelism -> DDP; tied GPT-2 DDP -> 2 stages -> DDP: each
resume a change of checkpoint format; 2 stages -> FSDP2 is DCP's own resharding,
tests/unit/test_pipeline_parallel.py)
continues with the losses of the run that never changed, and a ZeRO resume of another format is
refused before anything is queued."""

from __future__ import annotations

import pytest
import shared_results

from tests import equivalence as eq
from tests.memory_helpers import assert_states_as_planned

TP = ("tp2", "tp2+sp", "fsdp2xtp2", "tp2xpp2")
# the cells in three tests a model (xdist spreads them; each group's DDP reference is shared)
GROUPS = {"data": ("fsdp2", "zero1", "zero2", "zero3"), "tensor": TP,
          "pipeline": ("pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2-zero-bubble", "fsdp2xpp2")}
assert sorted(x for g in GROUPS.values() for x in g) == sorted(x for x in eq.LAYOUTS if x != "ddp")


def ddp_reference(model: str) -> eq.Trained:
    """DDP's run of ``model``: trained once per test run (tests/shared_results.py) for every test that
    compares with it, in a runs root of its own beside the shared results."""

    def train() -> eq.Trained:
        with pytest.MonkeyPatch.context() as mp:
            where = shared_results.directory() / "equivalence"
            where.mkdir(exist_ok=True)
            mp.setenv("LMLAUNCH_RUNS_ROOT", str(where / "runs"))
            got = eq.train(model, "ddp", where)
        assert isinstance(got, eq.Trained), got
        return got

    return shared_results.shared(f"equivalence-ddp-{model}", train)


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_every_way_to_scale_trains_the_model_ddp_trains(model, group, runs_root, tmp_path):
    ref = ddp_reference(model)
    initial = eq.initial_weights(model, tmp_path)
    rows, runs = [], {}
    for layout in GROUPS[group]:
        got = eq.train(model, layout, tmp_path)
        rows.append(eq.compare(model, layout, ref, got, initial=initial))
        if isinstance(got, eq.Trained):
            runs[layout] = got.run_dir
    text = eq.table(rows)
    print(text)
    assert all(norm > eq.CLIP for _, norm in ref.steps.values()), ref.steps  # clipping decides every step
    refused = {r.layout: r.said for r in rows if r.said}
    if model == "gpt2":  # no tensor-parallel plan in transformers: said before anything runs
        assert sorted(refused) == sorted(set(TP) & set(GROUPS[group])), text
        assert all("no tensor-parallel plan" in s for s in refused.values()), text
        rows, refused = [r for r in rows if r.layout not in TP], {}
    assert not refused and all(r.ok() for r in rows), text
    for run_dir in runs.values():
        assert_states_as_planned(run_dir)  # each rank's parameters, gradients and moments, as planned


@pytest.mark.slow
@pytest.mark.parametrize("model, chain", [
    ("llama", [("zero3", 3), ("ddp", 6), ("pp2-1f1b", 0)]),  # ZeRO's universal form -> DDP's file -> stages
    ("llama", [("zero2", 3), ("tp2+sp", 6), ("ddp", 0)]),  # ZeRO-1/2's optimizer file -> TP shards -> DDP
    # tied head: DDP counts it once, the last stage holds its copy under the head's name, FSDP2 once
    ("gpt2", [("ddp", 3), ("pp2-1f1b", 6), ("fsdp2", 0)]),
])
def test_a_run_resumed_under_another_strategy_continues_the_unchanged_runs_losses(model, chain, runs_root, tmp_path):
    from tests.unit.test_checkpoint_resume import _ledger

    ref = ddp_reference(model)
    for i, (layout, stop_at) in enumerate(chain):
        got = eq.train(model, layout, tmp_path, name=f"across-{model}-{chain[0][0]}", stop_at=stop_at, resume=i > 0)
        assert isinstance(got, eq.Trained), got
    starts = [e["start_step"] for e in _ledger(got.run_dir) if e["event"] == "start"]
    assert starts == [0, chain[0][1], chain[1][1]], starts
    row = eq.compare(model, "across", ref, got, initial=eq.initial_weights(model, tmp_path))
    assert row.ok(), eq.table([row])  # every step's loss and norm, and the final weights, as DDP's


def test_resuming_another_strategys_checkpoint_with_zero_is_refused_before_anything_is_queued(runs_root, tmp_path):
    from lmcore.errors import UserError

    got = eq.train("llama", "ddp", tmp_path, name="into-zero", stop_at=0, max_steps=1)
    assert isinstance(got, eq.Trained), got
    with pytest.raises(UserError, match=r"this plan uses DeepSpeed ZeRO, which loads only its own checkpoints. "
                                        r"Resume with trainer.strategy ddp or fsdp \(with tensor or pipeline"):
        eq.plan("llama", "zero2", tmp_path, name="into-zero", resume=True)
