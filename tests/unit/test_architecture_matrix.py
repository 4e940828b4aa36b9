"""The architecture matrix: a tiny config of each common causal LM type trains two steps on two
ranks under FSDP2 (and the types whose parameters ZeRO-3 gathers differently, under DeepSpeed
ZeRO-3 too: tied embeddings, experts, ALiBi) through the real entry, and its export is the model
that was trained: ``from_pretrained`` gives the logits the training ranks computed at the end
(every rank took part: the shards were gathered), ``generate`` runs and stays inside the
vocabulary, and the exported tokenizer gives the training ids on ASCII, NFD, emoji and
whitespace text, never an id outside the vocabulary. Where transformers forces a tokenizer class
by model type (qwen2), the export says so and names the loading line that gives the training
ids; the test holds it to that line."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launcher.submit.local_run import prepare_local_run
from lmtrain.local.launch import launch
from lmtrain.model.causal_lm import model_shape
from tests.memory_helpers import assert_states_as_planned
from tests.unit.test_export import lm

HELPER = Path(__file__).with_name("_train_with_stop.py")
VOCAB = 260
TOKENS = {"vocab_size": VOCAB, "pad_token_id": 256, "bos_token_id": 256, "eos_token_id": 256}
LLAMA_LIKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
HEAD_DIM = {**LLAMA_LIKE, "head_dim": 16}
# Each type's own names for the sizes (gpt2's n_embd, opt's ffn_dim, gpt_neo's attention_types, the
# experts of mixtral and qwen2_moe); the same width, one layer, two heads everywhere.
ARCHITECTURES = {
    "llama": LLAMA_LIKE, "mistral": LLAMA_LIKE, "qwen2": LLAMA_LIKE, "qwen3": HEAD_DIM, "phi3": LLAMA_LIKE,
    "olmo2": LLAMA_LIKE, "starcoder2": LLAMA_LIKE, "gemma": HEAD_DIM, "gemma2": HEAD_DIM,
    "gemma3_text": {**HEAD_DIM, "sliding_window": 16},
    "phi": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 64},
    "gpt_neox": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "max_position_embeddings": 64},
    "gpt2": {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64},
    "gpt_neo": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "attention_types": [[["global"], 1]],
                "max_position_embeddings": 64, "intermediate_size": 64},
    "opt": {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 64, "word_embed_proj_dim": 32},
    "bloom": {"hidden_size": 32, "n_layer": 1, "n_head": 2},
    "falcon": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
    "mixtral": {**LLAMA_LIKE, "num_local_experts": 2, "num_experts_per_tok": 1},
    "qwen2_moe": {**LLAMA_LIKE, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                  "num_experts": 2, "num_experts_per_tok": 1},
}
STRATEGIES = {"fsdp": ["trainer.strategy=fsdp"],
              "zero3": ["trainer.strategy=deepspeed", "trainer.zero_stage=3"]}
# ZeRO-3's own export path (partitions gathered by parameter name) for the types that differ in what
# it gathers: tied embeddings (gpt2, gemma2), experts (mixtral, qwen2_moe), ALiBi (bloom), and llama;
# the rest share their parameter layout with these and go through FSDP2's DCP gather.
ZERO3_TYPES = frozenset({"llama", "gpt2", "gemma2", "mixtral", "qwen2_moe", "bloom"})
OVERRIDES = ["data.seq_len=16", "data.micro_batch_size=2", "trainer.global_batch_size=4", "trainer.log_every_n_steps=1",
             "trainer.val_check_interval=null", "logging.tensorboard=false", "logging.csv=false"]


def _train(repo: Path, tmp_path: Path, model_type: str, strategy: str) -> tuple[str, dict]:
    spec = yaml.safe_load((repo / "jobs" / "tiny-cpu.yaml").read_text())
    spec["model"] = {"type": model_type, "config": {**ARCHITECTURES[model_type], **TOKENS}}
    spec["data"]["path"] = str(repo / "data" / "prepared" / "tiny")
    path = tmp_path / f"{model_type}-{strategy}.yaml"
    path.write_text(yaml.safe_dump(spec))
    plan = prepare_local_run(str(path), [*OVERRIDES, *STRATEGIES[strategy]], devices=2, max_steps=2,
                             name=f"{model_type}-{strategy}", environ=dict(os.environ), say=lambda *_: None, resume=False)
    run_dir = plan.paths.run_dir
    out = Path(run_dir) / "launcher.out"
    code = launch(run_dir, 2, plan_env=plan.env, threads_per_proc=1,
                  command=[sys.executable, "-u", str(HELPER), run_dir, "0"], out=open(out, "w"))
    assert code == 0, out.read_text()[-3000:]
    assert plan.memory is not None, plan.notes  # traced for every architecture that validates
    assert_states_as_planned(run_dir)  # and what the ranks held is what the plan said
    return run_dir, torch.load(Path(run_dir, "final-logits.pt"), weights_only=True)  # logits and model shape


def _check_export(runs_root: Path, run_dir: str, trained: dict, out: Path, step: int = 2) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from lmtrain.checkpoint.export import PROBE_TEXTS

    code, text = lm(runs_root, "export", run_dir, "--to", "hf", out)
    assert code == 0 and f"step-{step} (the newest complete checkpoint)" in text, text
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=trained["input_ids"], use_cache=False).logits
        assert torch.allclose(logits, trained["logits"], atol=1e-5, rtol=0), (logits - trained["logits"]).abs().max()
        generated = model.generate(trained["input_ids"][:, :8], max_new_tokens=4, do_sample=False,
                                   pad_token_id=256)
    assert generated.shape == (1, 12) and int(generated.max()) < VOCAB, generated

    # what MFU counts of the model as it trained (ZeRO-3's parameters partitioned) is the whole model's
    assert trained["shape"] == dataclasses.asdict(model_shape(model)), trained["shape"]
    summary = json.loads((out / "lmlaunch_export.json").read_text())
    assert summary["parameters"] == sum(p.numel() for p in model.parameters()), summary  # tied weights once
    auto = AutoTokenizer.from_pretrained(out)
    documented = [auto] if not summary["tokenizer_problems"] else [PreTrainedTokenizerFast.from_pretrained(out)]
    for problem in summary["tokenizer_problems"]:  # said in the export's output, with the line that works
        assert "load it with PreTrainedTokenizerFast.from_pretrained(DIR)" in problem, problem
        assert problem.replace("(DIR)", f"({str(out)!r})") in text, text
    for tok in (auto, *documented):
        for probe in PROBE_TEXTS:
            ids = tok(probe, add_special_tokens=False)["input_ids"]
            assert all(0 <= i < VOCAB for i in ids), (type(tok).__name__, probe, ids)
    for probe in PROBE_TEXTS:
        assert documented[0](probe, add_special_tokens=False)["input_ids"] == list(probe.encode("utf-8")), probe


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_each_architecture_trains_sharded_and_exports_the_trained_model(repo, runs_root, tmp_path,
                                                                                  model_type):
    for strategy in STRATEGIES:
        if strategy == "zero3" and model_type not in ZERO3_TYPES:
            continue
        run_dir, trained = _train(repo, tmp_path, model_type, strategy)
        beats = [json.loads(x) for x in Path(run_dir, "metrics", "heartbeat.jsonl").read_text().splitlines()]
        losses = [b["loss"] for b in beats if b["event"] == "step"]
        assert len(losses) == 2 and all(abs(x - 5.56) < 0.6 for x in losses), (strategy, losses)  # ~ln(260)
        _check_export(runs_root, run_dir, trained, tmp_path / f"hf-{strategy}")
