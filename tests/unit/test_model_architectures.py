"""Architectures other than GPT-2 build and train as their spec says (issue: every causal LM that
validates trains): ZeRO-3 initialises a model with a pad token (its embedding's padding row used to
fail on each rank's empty partition), the attention kernel defaults to the best one the
architecture supports (sdpa was forced, and bloom, gemma2, gpt_neo, mpt, ... have none), an
explicit unsupported kernel and a pad token id outside the vocabulary are refused naming the
setting."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from launcher.commands.run import prepare_local_run
from lmtrain.local import launch
from lmtrain.model import attention_for, build_config


@pytest.mark.parametrize("model_type, expected", [("llama", "sdpa"), ("bloom", "eager"), ("gemma2", "eager"),
                                                  ("gpt_neo", "eager"), ("opt", "sdpa")])
def test_auto_attention_is_the_best_kernel_the_architecture_supports(model_type, expected):
    spec = {"type": model_type, "config": {"vocab_size": 260}}
    assert attention_for(spec, build_config(spec)) == expected
    assert attention_for({**spec, "attn_implementation": "eager"}, build_config(spec)) == "eager"


def test_an_attention_kernel_the_architecture_lacks_is_refused_naming_the_setting():
    spec = {"type": "bloom", "config": {"vocab_size": 260}, "attn_implementation": "sdpa"}
    with pytest.raises(ValueError, match=r"model\.attn_implementation is sdpa, which BloomForCausalLM does not "
                                         r"support; use auto or one of: eager"):
        attention_for(spec, build_config(spec))


def test_a_default_pad_token_outside_a_small_vocabulary_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"model\.config\.pad_token_id is 32000 \(the default of phi3\), outside the "
                                         r"vocabulary: vocab_size is 260.*set model\.config\.pad_token_id to an id below 260"):
        build_config({"type": "phi3", "config": {"vocab_size": 260}})
    with pytest.raises(ValueError, match=r"pad_token_id is 300 \(set in model\.config\)"):
        build_config({"type": "llama", "config": {"vocab_size": 260, "pad_token_id": 300}})
    assert build_config({"type": "phi3", "config": {"vocab_size": 260, "pad_token_id": 259}}).pad_token_id == 259


TINY = {
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 260, "pad_token_id": 0,
              "bos_token_id": 256, "eos_token_id": 256},
    "bloom": {"hidden_size": 32, "n_layer": 1, "n_head": 2, "vocab_size": 260, "pad_token_id": 3,
              "bos_token_id": 256, "eos_token_id": 256},
}


@pytest.mark.parametrize("model_type, strategy", [("llama", ["trainer.strategy=deepspeed", "trainer.zero_stage=3"]),
                                                  ("bloom", ["trainer.strategy=fsdp"])],
                         ids=["llama-pad-zero3", "bloom-auto-attention-fsdp"])
def test_an_architecture_with_a_pad_token_or_without_sdpa_trains_on_two_ranks(repo, runs_root, tmp_path, model_type, strategy):
    spec = yaml.safe_load((repo / "jobs" / "tiny-cpu.yaml").read_text())
    spec["model"] = {"type": model_type, "config": TINY[model_type]}
    spec["data"]["path"] = str(repo / "data" / "prepared" / "tiny")
    path = tmp_path / f"{model_type}.yaml"
    path.write_text(yaml.safe_dump(spec))
    plan = prepare_local_run(str(path), ["data.seq_len=32", "data.micro_batch_size=4", "trainer.global_batch_size=8",
                                         "trainer.log_every_n_steps=1", "trainer.val_check_interval=null", *strategy],
                             devices=2, max_steps=3, name=model_type, environ=dict(os.environ), say=lambda *_: None,
                             resume=False)
    out = Path(plan.paths.run_dir) / "launcher.out"
    assert launch(plan.paths.run_dir, 2, plan_env=plan.env, threads_per_proc=1, out=open(out, "w")) == 0, out.read_text()[-3000:]
    beats = [json.loads(x) for x in Path(plan.paths.heartbeat).read_text().splitlines()]
    losses = [b["loss"] for b in beats if b["event"] == "step"]
    # initialised as the architecture means (not a partition's leftovers): starts near ln(vocab)
    assert len(losses) == 3 and abs(losses[0] - math.log(260)) < 0.5, losses


def test_the_known_model_types_are_the_installed_transformers_ones_without_importing_it():
    """Validation reads the installed transformers' causal LM types from its source, without the
    import (the static list of 5.23 refused exaone, apertus1p5_text, ... that 5.24 builds)."""
    import subprocess
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from launcher.core.model_types import causal_lm_types
    from launcher.core.spec import ModelSpec

    assert causal_lm_types() == frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert ModelSpec(type="exaone").type == "exaone"
    with pytest.raises(ValueError, match=r"model\.type\(llamma\) is not a transformers causal LM type.*did you mean"):
        ModelSpec(type="llamma")
    probe = ("import sys; from launcher.core.model_types import causal_lm_types; n = len(causal_lm_types()); "
             "print(n, 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)), "False", "False"]
