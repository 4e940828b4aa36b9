"""The memory plan against measurement, on the CPU.

- Activations: the bytes a real training step saves for backward (``saved_tensors_hooks``, each
  storage once, parameters excluded) against the plan's figure, traced with fake tensors at micro
  batches 1 and 2 and extrapolated: GPT-2 and Llama (grouped-query) shapes, several sequence
  lengths and micro batches, with and without activation checkpointing, under autocast and in
  fp32 (Lightning's precisions) and in bf16 (DeepSpeed's cast model). Within 10 %.
- Model states: what each rank of a real run holds (the ledger's ``memory`` line) against the
  estimate, within 1 %, for the strategy x world-size pairs the checkpoint and elastic-resume tests
  do not train (those tests check their own runs: tests/memory_helpers.py).
- The refusal: a 7B model under DDP on 80 GB GPUs is refused with its breakdown and ranked fixes,
  and the first fix validates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from launcher.planning import memory
from launcher.planning.memory_inputs import model_facts
from launcher.spec.jobfile import load_job
from lmcore.job.parallelism import DataParallel, Parallelism
from lmtrain.model.causal_lm import attention_for, build_config, model_settings

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs" / "tiny-cpu.yaml"
SHAPES = {
    "gpt2": ["model.type=gpt2", "model.config.n_layer=2", "model.config.n_embd=96", "model.config.n_head=4",
             "model.config.n_positions=256"],
    "llama": ["model.type=llama", "model.config={hidden_size: 96, intermediate_size: 256, num_hidden_layers: 2, "
              "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256, vocab_size: 260, "
              "bos_token_id: 256, eos_token_id: 256}"],
}


def _measured(spec, micro_batch: int, compute: str, checkpointing: bool) -> int:
    """Bytes one real training forward saves for backward, counted as the trace counts them."""
    from transformers import AutoModelForCausalLM

    m = model_settings(spec.model)
    config = build_config(m)
    autocast = compute.startswith("autocast-")
    dtype = torch.float32 if autocast else {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(m, config), dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, config.vocab_size, (micro_batch, spec.data.seq_len))
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("arch", sorted(SHAPES))
@pytest.mark.parametrize("seq_len, micro_batch", [(64, 3), (192, 1)])
@pytest.mark.parametrize("compute", ["autocast-bf16", "fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_activations_saved_by_a_real_step_match_the_plan(arch, seq_len, micro_batch, compute, checkpointing):
    spec = load_job(TINY, [*SHAPES[arch], f"data.seq_len={seq_len}"])
    facts = model_facts(spec)
    planned, _head = memory._trace(facts, compute, checkpointing, micro_batch)
    measured = _measured(spec, micro_batch, compute, checkpointing)
    assert abs(planned - measured) <= 0.10 * measured, f"planned {planned:,} B, a real step saved {measured:,} B"


def test_rows_follow_the_engines_accounting():
    """The arithmetic on a model whose numbers are easy to follow: 2 parameters of 10 and 7 elements."""
    facts = memory.ModelFacts(params=((10, 5, 2, 0), (7, 7, 1, -1)), blocks=1, vocab_size=4, seq_len=8,
                              traces={("fp32", False): (100, 10, 180, 20), ("bf16", False): (50, 5, 90, 10)})
    ddp = Parallelism.of("ddp", 2)
    base = memory.Setup(parallelism=ddp, offload_optimizer=False, offload_params=False,
                        precision="32-true", micro_batch=3, global_batch=6, checkpointing=False, gpu=False)
    rows = {r.name: r.bytes for r in memory.estimate(facts, base).rows}
    assert rows["parameters"] == 4 * 17 and rows["gradients"] == 4 * 17 and rows["optimizer states"] == 8 * 17 + 8
    assert rows["activations"] == (100 + 2 * 80) - (10 + 2 * 10)  # micro batch 3, linear from 1 and 2
    fsdp = {r.name: r.bytes for r in memory.estimate(facts, base.on(ddp.with_data(DataParallel.SHARD))).rows}
    assert fsdp["parameters"] == 4 * (3 * 2 + 4 * 1)  # ceil(5/2)=3 rows of 2; ceil(7/2)=4 rows of 1
    z2 = dataclasses.replace(base, parallelism=ddp.with_data(DataParallel.ZERO, 2), precision="bf16-mixed")
    rows = {r.name: r.bytes for r in memory.estimate(facts, z2).rows}
    # groups [10] and [7] padded to multiples of 4: 12 and 8, parts 6 and 4; rank 1 holds 10 + 7 gradient elements
    assert rows["parameters"] == 2 * 20 and rows["optimizer states"] == 12 * 10 + 8 and rows["gradients"] == 2 * 17
    z3 = z2.on(ddp.with_data(DataParallel.ZERO, 3))
    rows = {r.name: r.bytes for r in memory.estimate(facts, z3).rows}
    assert rows["parameters"] == 2 * (5 + 4) and rows["optimizer states"] == 12 * 9 + 8


MISSING_PAIRS = [("zero1", 1), ("ddp", 4), ("zero2", 4), ("zero3", 4)]  # the others: checkpoint and elastic tests
STRATEGIES = {"ddp": ["trainer.strategy=ddp"], "zero1": ["trainer.strategy=deepspeed", "trainer.zero_stage=1"],
              "zero2": ["trainer.strategy=deepspeed", "trainer.zero_stage=2"],
              "zero3": ["trainer.strategy=deepspeed", "trainer.zero_stage=3"]}


@pytest.mark.parametrize("strategy, devices", MISSING_PAIRS, ids=[f"{s}-{d}" for s, d in MISSING_PAIRS])
def test_model_states_each_rank_holds_are_the_planned_ones(repo, runs_root, strategy, devices):
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch
    from tests.memory_helpers import assert_staging_as_planned, assert_states_as_planned

    overrides = ["model.config.n_layer=1", "model.config.n_embd=48", "model.config.n_head=2", "data.seq_len=32",
                 "model.config.n_positions=32", "data.micro_batch_size=2", f"trainer.global_batch_size={2 * devices}",
                 "trainer.precision=bf16-mixed", "trainer.limit_val_batches=0", "checkpoint.every_n_steps=100",
                 *STRATEGIES[strategy]]
    plan = prepare_local_run(str(TINY), overrides, devices=devices, max_steps=2, name=f"mem-{strategy}-{devices}",
                             environ=dict(os.environ), say=lambda *_: None)
    rc = launch(plan.paths.run_dir, devices, plan_env=plan.env, threads_per_proc=1,
                out=open(Path(plan.paths.run_dir) / "launcher.out", "w"))
    assert rc == 0, (Path(plan.paths.run_dir) / "launcher.out").read_text()[-3000:]
    assert plan.memory is not None and plan.memory["peak"] > 0
    assert_states_as_planned(plan.paths.run_dir)
    assert_staging_as_planned(plan.paths.run_dir)  # the staged checkpoints' host buffers, as planned


def test_a_7b_model_under_ddp_is_refused_with_ranked_fixes_and_the_first_one_validates():
    """In this process: resolve is what validate, submit and the dry run call (the CLI prints the
    UserError's message on stderr and exits with its code)."""
    from launcher.planning.memory_check import planned, proposal
    from launcher.planning.resolve import resolve
    from lmcore.errors import UserError

    spec, ddp = "jobs/llama-7b-zero3.yaml", ["trainer.strategy=ddp", "trainer.zero_stage=null"]
    env = {**os.environ}
    with pytest.raises(UserError) as exc:
        resolve(str(REPO / spec), ddp, environ=env)
    assert exc.value.exit_code == 4  # what the CLI exits with, the message on stderr
    err = str(exc.value)
    assert "does not fit the GPU's 80G of profile 'h100-ib'" in err, err
    for row in ("parameters", "gradients", "optimizer states", "activations", "logits and loss",
                "communication buffers", "framework", "peak per rank"):
        assert f"  {row} " in err, (row, err)
    fixes = [line for line in err.splitlines() if line[:5] in ("  1. ", "  2. ", "  3. ")]
    assert len(fixes) >= 2, err
    first = fixes[0].removeprefix("  1. ").split("  -> ")[0].split()
    assert first[0] == "trainer.strategy=deepspeed", fixes
    ok = resolve(str(REPO / spec), [*ddp, *first], environ=env)  # the first fix validates
    assert ok.plan.memory is not None and ok.plan.memory["fits"] is True
    forced = resolve(str(REPO / spec), ddp, environ=env, force=True)
    assert forced.plan.memory["fits"] is False and any("(--force)" in n for n in forced.plan.notes)
    got = planned(forced.spec, forced.profile, forced.plan, env)
    assert not isinstance(got, str)
    fit = proposal(got, forced.profile)
    assert fit[0].startswith("fit: trainer.strategy=deepspeed"), fit
    from launcher.planning import memory_fixes as m

    best = m.best_fit(got.facts, got.setup, got.breakdown.capacity)
    assert best is not None and best.breakdown.fits
    micro = dict(best.changes)["data.micro_batch_size"] if "data.micro_batch_size" in dict(best.changes) else 2
    assert 256 % (micro * 32) == 0  # the global batch kept: 256 = micro x accumulation x 32 ranks
    for b in (4, 8):  # a larger micro batch does not fit even with the least memory the search allows
        if b > micro:
            least = dataclasses.replace(got.setup, micro_batch=b, checkpointing=True, offload_optimizer=True,
                                        parallelism=got.setup.parallelism.with_data(DataParallel.ZERO, 3))
            assert not m.estimate(got.facts, least, got.breakdown.capacity).fits


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_a_gpu_jobs_attention_dropout_is_traced_as_the_flash_kernel_runs_it(checkpointing):
    """GPT-2 trains with attention dropout: the CPU takes SDPA's math kernel for it (the whole
    attention matrix saved), CUDA's flash kernel applies it inside (nothing more saved than without
    dropout). A GPU job's trace equals a real CPU step of the same model without attention dropout
    (the CPU's flash kernel), and is below the CPU job's trace (equal with checkpointing)."""
    spec = load_job(TINY, [*SHAPES["gpt2"], "data.seq_len=128"])
    gpu = memory._trace(model_facts(spec, gpu=True), "autocast-bf16", checkpointing, 2)[0]
    cpu = memory._trace(model_facts(spec), "autocast-bf16", checkpointing, 2)[0]
    no_dropout = load_job(TINY, [*SHAPES["gpt2"], "data.seq_len=128", "model.config.attn_pdrop=0.0"])
    assert gpu == _measured(no_dropout, 2, "autocast-bf16", checkpointing)
    assert gpu < cpu if not checkpointing else gpu == cpu  # checkpointing saves only the blocks' inputs
