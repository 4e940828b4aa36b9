"""What the model section of a spec means for architectures other than GPT-2 (every causal LM
that validates trains): the attention kernel defaults to the best one the architecture supports
(sdpa was forced, and bloom, gemma2, gpt_neo, mpt, ... have none), an explicit unsupported kernel
and a pad token id outside the vocabulary are refused naming the setting, and the known types are
the installed transformers' ones. Each common architecture training on two ranks under FSDP2 and
ZeRO-3 (whose init used to fail on a pad token's row): tests/unit/test_architecture_matrix.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from lmtrain.model.causal_lm import attention_for, build_config


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


def test_the_known_model_types_are_the_installed_transformers_ones_without_importing_it():
    """Validation reads the installed transformers' causal LM types from its source, without the
    import (the static list of 5.23 refused exaone, apertus1p5_text, ... that 5.24 builds)."""
    import subprocess
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lmcore.job.model_types import causal_lm_types
    from lmcore.job.spec import ModelSpec

    assert causal_lm_types() == frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert ModelSpec(type="exaone").type == "exaone"
    with pytest.raises(ValueError, match=r"model\.type\(llamma\) is not a transformers causal LM type.*did you mean"):
        ModelSpec(type="llamma")
    probe = ("import sys; from lmcore.job.model_types import causal_lm_types; n = len(causal_lm_types()); "
             "print(n, 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)), "False", "False"]


def _validate(repo, tmp_path, model: dict, name: str = "m", overrides: tuple[str, ...] | list[str] = ()) -> tuple[int, str]:
    import io

    from launcher.cli import main
    from launcher.context import Context

    spec = yaml.safe_load((repo / "jobs" / "tiny-cpu.yaml").read_text())
    spec["model"] = model
    spec["data"]["path"] = str(repo / "data" / "prepared" / "tiny")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = io.StringIO()
    code = main(["validate", str(path), *overrides], Context(stdout=out, stderr=out, environ={
        "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "XDG_CACHE_HOME": str(tmp_path / "cache")}))
    return code, out.getvalue()


def test_validate_refuses_a_model_section_transformers_cannot_build_naming_the_line(repo, tmp_path):
    """Whatever validates builds: validate, dry runs and submit check the model section with the
    runtime's own check (the config's token ids, the attention kernel, the construction on the meta
    device, and for a model up to 20 M parameters one training step on the CPU: codegen's default
    rotary_dim 64 is wider than a 16-wide head), before anything is written or submitted, and name
    the line."""
    from launcher.planning import model_check

    cases = {
        "phi3-pad": ({"type": "phi3", "config": {"vocab_size": 260, "hidden_size": 32, "num_attention_heads": 2,
                                                 "num_hidden_layers": 1, "intermediate_size": 64}},
                     r"line \d+: model\.config\.pad_token_id is 32000 \(the default of phi3\), outside the vocabulary"),
        "bloom-sdpa": ({"type": "bloom", "config": {"vocab_size": 260}, "attn_implementation": "sdpa"},
                       r"line \d+: model\.attn_implementation is sdpa, which BloomForCausalLM does not support; "
                       r"use auto or one of: eager"),
        "bloom-heads": ({"type": "bloom", "config": {"vocab_size": 260, "hidden_size": 66, "n_head": 4}},
                        r"line \d+: model\.config: transformers cannot build BloomConfig with it: ValueError: "
                        r"`hidden_size` must be divisible by num_heads"),
        "codegen-rotary": ({"type": "codegen", "config": {"vocab_size": 260, "n_embd": 64, "n_head": 4, "n_layer": 1}},
                           r"line \d+: model\.config: CodeGenConfig builds but its first training step fails \(checked "
                           r"on the CPU with 8 tokens, [\d,]+ parameters\): RuntimeError: The size of tensor a \(16\)"),
    }
    for name, (model, expected) in cases.items():
        code, text = _validate(repo, tmp_path, model, name)
        assert code == 4 and re.search(expected, text), (name, text)
        assert "[transformers]" not in text, text  # said once, by lmlaunch
    assert not (tmp_path / "runs").exists()
    code, text = _validate(repo, tmp_path, {"type": "bloom", "config": {"vocab_size": 260, "hidden_size": 64, "n_head": 4}})
    assert code == 0 and text.startswith("ok:"), text
    # the answers are kept per model section (and transformers version): the next command reads them
    kept = sorted((tmp_path / "cache" / "lmlaunch" / "model-checks").glob("*.json"))
    assert len(kept) == 5, kept
    model_check._seen.clear()
    for f in kept:  # a kept answer is what the next command says, without building anything
        f.write_text(json.dumps({"problem": "model.config: (the kept answer)"}) + "\n")
    code, text = _validate(repo, tmp_path, {"type": "bloom", "config": {"vocab_size": 260, "hidden_size": 64, "n_head": 4}})
    assert code == 4 and "model.config: (the kept answer)" in text, text
    model_check._seen.clear()


def test_without_the_training_stack_the_model_check_is_left_to_doctor_and_said(repo, tmp_path, monkeypatch):
    from launcher.planning import model_check, runtime_stack

    monkeypatch.setattr(runtime_stack, "missing", lambda packages=runtime_stack.TRAINING_STACK: "torch")
    model_check._seen.clear()
    code, text = _validate(repo, tmp_path, {"type": "phi3", "config": {"vocab_size": 260}})
    assert code == 0 and "note: model section not checked against transformers here (torch is not installed" in text, text
    assert "`lmlaunch doctor` checks it where the jobs run" in text
