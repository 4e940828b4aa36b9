"""Composite model types (a vision or audio model around a language model) are refused at validate
with the reason and the text type to use instead (lmcore.job.model_types.composite_reason): their
language model's sizes live in a text_config sub-config, so model.config's sizes were ignored and a
multi-billion-parameter default was built. The verdict is read from transformers' files without
importing it; here it is checked against every causal LM type's imported config class."""

from __future__ import annotations

import io
import warnings

import pytest

from launcher.cli import main
from launcher.context import Context
from lmcore.job.model_types import causal_lm_types, composite_reason


def _declares_text_config(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    subs = getattr(cls, "sub_configs_defaults", None) or getattr(cls, "sub_configs", None) or {}
    return "text_config" in subs


def test_the_verdict_read_from_the_files_equals_the_imported_config_classes():
    from transformers import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        types = sorted(t for t in causal_lm_types() if t in CONFIG_MAPPING)
        composite = {t for t in types if _declares_text_config(t)}
    assert {t for t in types if composite_reason(t)} == composite
    assert {"gemma3", "llama4", "mllama"} <= composite and not {"llama", "gpt2", "gemma3_text", "qwen2_moe"} & composite


@pytest.mark.parametrize("model_type,instead", [("gemma3", "gemma3_text"), ("llama4", "llama4_text"), ("mllama", None)])
def test_a_composite_type_is_refused_at_validate_naming_the_text_type(repo, model_type, instead):
    out, err = io.StringIO(), io.StringIO()
    code = main(["validate", str(repo / "jobs" / "tiny-cpu.yaml"), f"model.type={model_type}", "model.config={hidden_size: 64}"],
                Context(stdout=out, stderr=err))
    assert code == 4, out.getvalue()
    text = err.getvalue()
    assert f"model.type({model_type}) is a composite model" in text and "text_config" in text, text
    assert (f"its language model alone is the type {instead}" if instead else "choose a text-only type") in text, text
