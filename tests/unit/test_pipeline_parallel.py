"""Pipeline parallelism (trainer.pipeline_parallel_size, torch.distributed.pipelining, FSDP2 per stage):

- (every schedule, TP x PP and FSDP2 x PP against DDP through the real entry, step by step, with the
  shipped specs' clipping, for a tied GPT-2 and an untied Llama: tests/unit/test_equivalence_matrix.py)
- GPT-2, GPT-NeoX, Phi, Gemma, Falcon and OPT (four of them with a tied head) split and train with
  1F1B as DDP does over the same 2 processes (a hand loop), within 1e-4 for 8 steps;
- through the real entry (lmtrain.local.launch, lmtrain's strategy, sampler and DCP checkpoints): a pp2
  run gives the 2-rank DDP run's losses; stopped and resumed at the same layout it is bit-identical;
  resumed pp2 -> pp1 -> dp2 (FSDP2 alone) -> pp2 it continues the uninterrupted curve (DCP reshards the
  stages' files: each holds its blocks under the whole model's names); its export loads with
  ``from_pretrained`` and gives the DDP run's export's logits;
- the planner's arithmetic and what cannot be split: exit 2 naming the key, nothing submitted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.submit.local_run import prepare_local_run
from lmcore.errors import SpecError
from lmcore.job import pipeline_stages
from lmtrain.checkpoint.manager import complete_checkpoints
from lmtrain.checkpoint.weights import lightning_state_dict
from tests.memory_helpers import assert_states_as_planned
from tests.unit.test_checkpoint_resume import _launch, _ledger, _steps, _val_losses
from tests.unit.test_tensor_parallel import _spec as tiny_llama_spec

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("_pp_losses.py")


@pytest.mark.slow
def test_other_architectures_split_and_train_as_ddp_does(tmp_path):
    """The splitter finds the stages of architectures with learned positions (GPT-2; OPT's, called
    with the attention mask and more arguments, stood in for on the later stage), partial rotary
    (GPT-NeoX, Phi), scaled embeddings (Gemma), parallel attention (Falcon), and a head tied to the
    embedding (GPT-2, OPT, Gemma, Falcon: two copies on the first and last stage, their gradients
    summed and counted once in the clipped norm): 1F1B on 2 ranks gives DDP's losses and gradient
    norms over 8 steps, and the interleaved schedule (stage 0 and the last stage on different ranks)
    too for tied GPT-2."""
    out = tmp_path / "losses.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    runs = {"gpt2": ["1f1b", "interleaved_1f1b"], "gpt_neox": ["1f1b"], "phi": ["1f1b"], "gemma": ["1f1b"],
            "falcon": ["1f1b"], "opt": ["1f1b"]}
    archs = ",".join(f"{a}:{'+'.join(s)}" for a, s in runs.items())
    done = subprocess.run([sys.executable, str(HELPER), str(out), archs, "1f1b", "8"], env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(result) == sorted(runs)
    for arch, layouts in result.items():
        ddp = layouts.pop("ddp")
        assert sorted(layouts) == sorted(runs[arch]) and len(ddp) == 8
        for schedule, steps in layouts.items():
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, ddp, strict=True)):
                assert abs(loss - ref_loss) < 1e-4, (arch, schedule, step, loss, ref_loss)
                assert abs(norm - ref_norm) < 1e-3 * ref_norm, (arch, schedule, step, norm, ref_norm)
        assert all(norm > 0 for _, norm in ddp)


# --- through the real entry ----------------------------------------------------------------
LLAMA = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 260, "pad_token_id": 256,
         "bos_token_id": 256, "eos_token_id": 256, "tie_word_embeddings": False}
OVERRIDES = ["data.seq_len=32", "data.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.log_every_n_steps=1",
             "trainer.val_check_interval=6", "trainer.limit_val_batches=1", "checkpoint.every_n_steps=4",
             "checkpoint.keep_last=2", "optim.warmup_steps=3", "logging.tensorboard=false",
             "trainer.sequence_parallel=false"]
MAX_STEPS = 12
LAYOUTS = {  # devices, strategy, pipeline, tensor
    "pp2": (2, "fsdp", 2, 1), "pp1": (1, "fsdp", 1, 1), "dp2": (2, "fsdp", 1, 1), "ddp2": (2, "ddp", 1, 1),
    "one-rank": (1, "fsdp", 1, 1)}


def _spec(tmp_path: Path) -> Path:
    return tiny_llama_spec(tmp_path, LLAMA, "pp")


def _plan(spec: Path, name: str, layout: str, *extra: str):
    devices, strategy, pp, tp = LAYOUTS[layout]
    return prepare_local_run(
        str(spec), [*OVERRIDES, f"trainer.strategy={strategy}", f"trainer.pipeline_parallel_size={pp}",
                    f"trainer.tensor_parallel_size={tp}", *extra],
        devices=devices, max_steps=MAX_STEPS, name=name, environ=dict(os.environ), say=lambda *_: None,
        resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir())


def _final_weights(run_dir: str) -> dict:
    return lightning_state_dict(complete_checkpoints(Path(run_dir) / "checkpoints")[-1].path)


@pytest.mark.slow
def test_pp2_matches_ddp_resumes_on_every_layout_and_exports(runs_root, tmp_path):
    spec = _spec(tmp_path)
    ref = {}
    for layout in ("ddp2", "pp2", "one-rank"):
        # one rank, micro batch 8: validates on the pipeline's batch of 4 microbatches of 2
        plan = _plan(spec, f"pp-straight-{layout}", layout, *(["data.micro_batch_size=8"] if layout == "one-rank" else []))
        assert _launch(plan, stop_at=0) == 0, Path(plan.paths.run_dir, "launcher.out").read_text()[-3000:]
        ref[layout] = plan.paths.run_dir
    pp, ddp = _steps(ref["pp2"]), _steps(ref["ddp2"])
    assert sorted(pp) == sorted(ddp) == list(range(1, MAX_STEPS + 1))
    for step in pp:  # the same global batches: DDP's losses
        assert abs(pp[step][0] - ddp[step][0]) < 1e-5, (step, pp[step], ddp[step])
        assert abs(pp[step][1] - ddp[step][1]) < 1e-4 * ddp[step][1], (step, pp[step], ddp[step])
    val = _val_losses(ref["pp2"])  # the schedule's eval: the last stage's loss, the same samples as one rank's
    assert sorted(val) == [6, 12] and val == pytest.approx(_val_losses(ref.pop("one-rank")), abs=1e-5), val
    assert_states_as_planned(ref["pp2"])  # each stage's parameters, gradients and moments, as the memory plan said
    meta = json.loads((complete_checkpoints(Path(ref["pp2"]) / "checkpoints")[-1].path / "meta.json").read_text())
    assert (meta["strategy"], meta["pipeline_parallel_size"], meta["world_size"]) == ("fsdp", 2, 2)

    # stopped and resumed at the same layout: bit-identical
    same = _plan(spec, "pp-same", "pp2")
    assert _launch(same, stop_at=5) == 0
    assert _launch(_plan(spec, "pp-same", "pp2"), stop_at=0) == 0
    assert _steps(same.paths.run_dir) == pp

    # elastic: each layout reads the one before's DCP files
    name, chain = "pp-elastic", [("pp2", 4), ("pp1", 7), ("dp2", 10), ("pp2", 0)]
    for layout, stop_at in chain:
        plan = _plan(spec, name, layout)
        assert _launch(plan, stop_at=stop_at) == 0, (layout, Path(plan.paths.run_dir, "launcher.out").read_text()[-3000:])
    run_dir = plan.paths.run_dir
    starts = [(e["start_step"], e["world_size"]) for e in _ledger(run_dir) if e["event"] == "start"]
    assert starts == [(0, 2), (4, 1), (7, 2), (10, 2)], starts
    got = _steps(run_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step in got:
        assert got[step][0] == pytest.approx(pp[step][0], rel=1e-4), (step, got[step], pp[step])
    weights, straight = _final_weights(run_dir), _final_weights(ref["pp2"])
    assert weights.keys() == straight.keys() == _final_weights(ref["ddp2"]).keys()  # the whole model's names
    assert max(float((weights[k] - straight[k]).abs().max()) for k in weights) < 1e-4

    _exports_give_ddps_logits({k: ref[k] for k in ("ddp2", "pp2")}, tmp_path)


def _exports_give_ddps_logits(ref: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.unit.test_architecture_matrix import lm

    logits = {}
    ids = (torch.arange(32) * 7 % 256).unsqueeze(0)
    for layout, run_dir in ref.items():
        code, text = lm(Path(os.environ["LMLAUNCH_RUNS_ROOT"]), "export", run_dir, "--to", "hf", tmp_path / layout)
        assert code == 0 and f"step-{MAX_STEPS} (the newest complete checkpoint)" in text, text
        model = AutoModelForCausalLM.from_pretrained(tmp_path / layout).eval()
        with torch.no_grad():
            logits[layout] = model(input_ids=ids, use_cache=False).logits
    assert "fsdp x pipeline_parallel(2)" in text
    assert torch.allclose(logits["pp2"], logits["ddp2"], atol=1e-4, rtol=0), (logits["pp2"] - logits["ddp2"]).abs().max()


# --- what the planner says -------------------------------------------------------------------

def _refused(spec: Path, *overrides: str) -> str:  # (2 nodes x 2 tasks: world 4)
    from launcher.planning.resolve import resolve

    with pytest.raises(SpecError) as err:
        resolve(str(spec), ["trainer.pipeline_parallel_size=2", "trainer.tensor_parallel_size=1",
                            "trainer.sequence_parallel=false", "model.config.tie_word_embeddings=false", *overrides],
                environ=dict(os.environ))
    return str(err.value)


def test_the_arithmetic_that_does_not_work_is_refused_naming_the_key(tmp_path):
    spec = _spec(tmp_path)  # 2 nodes x 2 tasks: world 4
    assert ("world_size(4) = resources.nodes(2) x tasks_per_node(2) is not a multiple of trainer.tensor_parallel_size(1) "
            "x trainer.pipeline_parallel_size(3) = 3") in _refused(spec, "trainer.pipeline_parallel_size=3")
    assert "trainer.pipeline_parallel_size(2) needs trainer.strategy: fsdp" in _refused(spec, "trainer.strategy=ddp")
    assert ("trainer.pipeline_schedule 1f1b needs at least trainer.pipeline_parallel_size(2) microbatches per step"
            in _refused(spec, "trainer.global_batch_size=4", "data.micro_batch_size=2"))
    assert "4 stages need at least 4 layers; the model has 3" in _refused(
        spec, "trainer.pipeline_schedule=interleaved_1f1b", "model.config.num_hidden_layers=3")
    assert "model.config.num_hidden_layers(6) is not divisible by trainer.pipeline_parallel_size(2) x 2" in _refused(
        spec, "trainer.pipeline_schedule=interleaved_1f1b", "model.config.num_hidden_layers=6")
    assert "trainer.pipeline_split [1, 1] must give each of the 2 stages" in _refused(spec, "trainer.pipeline_split=[1,1]")
    assert "trainer.pipeline_microbatches(3) must divide each replica's share" in _refused(
        spec, "trainer.pipeline_microbatches=3")
    # what truly cannot be split, from the model's own structure: Gemma 3n's per-layer inputs
    assert ("trainer.pipeline_parallel_size(2): gemma3n_text: model.per_layer_model_projection (Linear) holds "
            "parameters beside the blocks") in _refused(
        spec, "model.type=gemma3n_text", "model.config={num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, "
        "num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 260, vocab_size_per_layer_input: 260, "
        "hidden_size_per_layer_input: 8, head_dim: 16, laurel_rank: 4, altup_num_inputs: 2, num_kv_shared_layers: 0}",
        "trainer.global_batch_size=64")
    assert "Input should be 'gpipe', '1f1b', 'interleaved_1f1b' or 'interleaved_zero_bubble'" in _refused(
        spec, "trainer.pipeline_schedule=zbv")
    assert "trainer.pipeline_split needs trainer.pipeline_parallel_size > 1" in _refused(
        spec, "trainer.pipeline_parallel_size=1", "trainer.pipeline_split=[2,2]")
    assert "trainer.pipeline_schedule interleaved_zero_bubble with data_parallel(2) x tensor_parallel(1): FSDP2" in _refused(
        spec, "trainer.pipeline_schedule=interleaved_zero_bubble", "trainer.global_batch_size=64")  # 4 ranks: dp2 x pp2
    pretrained = tmp_path / "pretrained"  # a pretrained directory's config.json, read before anything is submitted
    pretrained.mkdir()
    (pretrained / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "vocab_size": 260}))
    refused = _refused(spec, "model.type=null", "model.config={}", f"model.pretrained={pretrained}", "trainer.global_batch_size=64")
    assert "2 stages need at least 2 layers; the model has 1" in refused  # GPT-2 names it n_layer
    assert "trainer.sequence_parallel with trainer.pipeline_parallel_size(2)" in _refused(
        spec, "trainer.tensor_parallel_size=2", "trainer.sequence_parallel=true")


def test_the_dry_run_says_the_mesh_the_schedule_and_its_bubble(tmp_path):
    from launcher.planning.resolve import resolve

    plan = resolve(str(_spec(tmp_path)), ["trainer.pipeline_parallel_size=2", "trainer.tensor_parallel_size=1",
                                          "trainer.sequence_parallel=false", "trainer.global_batch_size=32",
                                          "trainer.pipeline_schedule=interleaved_1f1b"], environ=dict(os.environ)).plan
    par = plan.parallelism
    assert (par.pipeline, par.data_parallel_size, par.microbatches, plan.trainer.accumulate_grad_batches) == (2, 2, 2, 1)
    assert ("mesh: data_parallel(2) x pipeline_parallel(2) = world_size(4); micro_batch(8) x microbatches(2) x "
            "data_parallel(2) = global_batch(32)") in plan.topology.arithmetic()
    notes = "\n".join(plan.notes)
    assert "schedule interleaved_1f1b: 4 stages (2 a rank), 2 microbatches of 8" in notes
    assert "bubble (p-1)/(v m) = (2-1)/(2 x 2) = 25% of the step's compute" in notes


def test_stages_are_balanced_by_parameters_and_the_bubble_follows_the_schedule():
    smap = pipeline_stages.split_layers([10] * 8, 2, "1f1b", first_extra=30, last_extra=30)
    assert smap.layers == ((0, 4), (4, 8))
    smap = pipeline_stages.split_layers([10] * 8, 2, "1f1b", first_extra=40, last_extra=0)
    assert smap.layers == ((0, 2), (2, 8))  # the embedding weighs on the first stage: fewer layers there
    inter = pipeline_stages.split_layers([10] * 8, 2, "interleaved_1f1b")
    assert inter.layers == ((0, 2), (2, 4), (4, 6), (6, 8)) and inter.stages_of(1) == [1, 3]
    assert inter.describe()[0] == "stage 0 (pipeline rank 0): embedding, layers 0-1"
    assert inter.describe()[-1] == "stage 3 (pipeline rank 1): layers 6-7, norm, head"
    assert pipeline_stages.split_layers([1] * 4, 2, "1f1b", explicit=[1, 3]).layers == ((0, 1), (1, 4))
    assert pipeline_stages.bubble("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert pipeline_stages.bubble("interleaved_1f1b", 4, 8) == pytest.approx(3 / 16)
    assert pipeline_stages.bubble("interleaved_zero_bubble", 4, 8) == 0.0


@pytest.mark.parametrize("kind, config", [
    ("gpt2", {"n_layer": 6, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 4000}),  # tied, learned positions
    ("llama", {"num_hidden_layers": 6, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
               "vocab_size": 4000, "tie_word_embeddings": False}),
])
def test_the_plans_stage_map_is_the_runtimes(kind, config):
    """The dry run's stages (launcher.planning.memory_stages, from the model's facts) are the ones
    the runtime builds (lmtrain.model.pipeline.stage_map, from the model): a tied head counts on the
    last stage in both (it holds a copy of the embedding); a large vocabulary moves layers off the
    first and last stage alike."""
    from launcher.planning import memory, memory_stages
    from lmcore.job.parallelism import Parallelism
    from lmtrain.model import pipeline
    from lmtrain.model.causal_lm import meta_model
    from lmtrain.model.memory_facts import parameter_facts

    spec = {"type": kind, "config": config}
    data = parameter_facts(spec)
    assert (data["tied_head"] >= 0) == (kind == "gpt2")
    facts = memory.ModelFacts(params=tuple(tuple(p) for p in data["params"]), blocks=data["blocks"],
                              vocab_size=data["vocab_size"], seq_len=32, traces={}, tied_head=data["tied_head"])
    for schedule in ("1f1b", "interleaved_1f1b"):
        par = Parallelism.of("fsdp", 2, pipeline=2, schedule=schedule, microbatches=2)
        setup = memory.Setup(parallelism=par, offload_optimizer=False, offload_params=False, precision="32-true",
                             micro_batch=1, global_batch=2, checkpointing=False, gpu=False)
        planned = memory_stages.stage_map(facts, setup)
        built = pipeline.stage_map(meta_model(spec), 2, schedule)
        assert planned.layers == built.layers, (kind, schedule, planned.layers, built.layers)
