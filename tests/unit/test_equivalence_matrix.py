"""Every way to scale trains the model DDP trains (tests/equivalence.py, the harness and its
tolerances): the same tied GPT-2 and untied Llama, on the same data, with the shipped specs'
clipping (hit in every compared step), accumulation, weight decay, warmup and cosine, through the
real entry, as FSDP2, ZeRO 1-3, tensor parallel (with and without sequence parallelism), 2
pipeline stages under each schedule, FSDP2 x TP, TP x PP and FSDP2 x PP: the loss and gradient
norm of each of 8 steps and the final weights (read as export reads them) against DDP on 2 ranks,
and each rank's model states as the memory plan said. GPT-2 has no tensor-parallel plan: its TP
cells are refused by the planner, naming why. The slow cells (more architectures, bf16 autocast,
3D on 8 ranks) are bench/equivalence.py's."""

from __future__ import annotations

import pytest

from tests import equivalence as eq
from tests.memory_helpers import assert_states_as_planned

TP = ("tp2", "tp2+sp", "fsdp2xtp2", "tp2xpp2")
SUITE = [layout for layout in eq.LAYOUTS if layout not in ("ddp", "3d")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_every_way_to_scale_trains_the_model_ddp_trains(model, runs_root, tmp_path):
    ref = eq.train(model, "ddp", tmp_path)
    assert isinstance(ref, eq.Trained), ref
    rows, runs = [], {}
    for layout in SUITE:
        got = eq.train(model, layout, tmp_path)
        rows.append(eq.compare(model, layout, ref, got))
        if isinstance(got, eq.Trained):
            runs[layout] = got.run_dir
    text = eq.table(rows)
    print(text)
    assert all(norm > eq.CLIP for _, norm in ref.steps.values()), ref.steps  # clipping decides every step
    refused = {r.layout: r.said for r in rows if r.said}
    if model == "gpt2":  # no tensor-parallel plan in transformers: said before anything runs
        assert sorted(refused) == sorted(TP) and all("no tensor-parallel plan" in s for s in refused.values()), text
        rows, refused = [r for r in rows if r.layout not in TP], {}
    assert not refused and all(r.ok() for r in rows), text
    for run_dir in runs.values():
        assert_states_as_planned(run_dir)  # each rank's parameters, gradients and moments, as planned
