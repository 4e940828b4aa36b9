"""Model types that transformers can build as a causal LM (AutoModelForCausalLM).

:func:`causal_lm_types` reads them from the installed transformers without importing it (the
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` literal of its ``modeling_auto.py``, parsed once per file):
validating a spec never imports transformers or torch, and a type a newer transformers adds is
known at once. Where transformers is not installed (a login-node install without it) or its file
has another shape, :data:`KNOWN_CAUSAL_LM_TYPES` stands in: transformers 5.23.0's list, kept by
``python -m lmcore.job.model_types`` (which prints what the installed one adds or drops).
tests/unit/test_model_architectures.py checks the reading against the imported mapping.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

MAPPING_NAME = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


def causal_lm_types() -> frozenset[str]:
    """The causal LM types of the installed transformers, else :data:`KNOWN_CAUSAL_LM_TYPES`."""
    for root in _transformers_roots():
        path = Path(root) / "models" / "auto" / "modeling_auto.py"
        try:
            found = _types_in(str(path), path.stat().st_mtime_ns)
        except OSError:
            continue
        if found:
            return found
    return KNOWN_CAUSAL_LM_TYPES


def composite_reason(model_type: str) -> str | None:
    """Why ``model_type`` cannot be sized from ``model.config`` (None when it can): its config is a
    composite (a vision or audio model around a language model) whose language model's sizes live in
    a ``text_config`` sub-config, so top-level sizes such as hidden_size are ignored and the default
    text model (billions of parameters) is built. Read from the installed transformers' configuration
    file of that type (a ``text_config`` field of its config class), without importing it."""
    for root in _transformers_roots():
        folder = Path(root) / "models" / model_type.replace("-", "_")
        for path in sorted(folder.glob("configuration_*.py")):
            try:
                if _has_text_config(str(path), path.stat().st_mtime_ns):
                    text = f"{model_type}_text"
                    instead = (f"; its language model alone is the type {text}" if text in causal_lm_types()
                               else "; choose a text-only type")
                    return (f"model.type({model_type}) is a composite model: its language model's sizes live in "
                            f"a text_config sub-config that lmlaunch does not size, so model.config's sizes would be "
                            f"ignored and transformers' default text model built{instead}")
            except OSError:
                continue
    return None


def _transformers_roots() -> list[str]:
    """Where the installed transformers package lives (found, not imported); none when it is not."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


@functools.lru_cache(maxsize=64)
def _has_text_config(path: str, mtime_ns: int) -> bool:
    text = Path(path).read_text(encoding="utf-8")
    return re.search(r"^\s+text_config\s*:", text, re.M) is not None


@functools.lru_cache(maxsize=4)
def _types_in(path: str, mtime_ns: int) -> frozenset[str]:
    """The first elements of the pairs in ``MAPPING_NAME = OrderedDict([...])`` of that file
    (empty when the file has another shape)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == MAPPING_NAME and isinstance(node.value, ast.Call) and node.value.args
                and isinstance(node.value.args[0], ast.List)):
            return frozenset(
                pair.elts[0].value for pair in node.value.args[0].elts
                if isinstance(pair, ast.Tuple) and pair.elts and isinstance(pair.elts[0], ast.Constant)
                and isinstance(pair.elts[0].value, str)
            )
    return frozenset()


KNOWN_CAUSAL_LM_TYPES: frozenset[str] = frozenset(
    {
        "afmoe",
        "apertus",
        "arcee",
        "aria_text",
        "axk1",
        "axk2",
        "bailing_hybrid",
        "bamba",
        "bart",
        "beam",
        "bert",
        "bert-generation",
        "big_bird",
        "bigbird_pegasus",
        "biogpt",
        "bitnet",
        "blenderbot",
        "blenderbot-small",
        "bloom",
        "blt",
        "camembert",
        "codegen",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "cohere_compass_text",
        "cpmant",
        "ctrl",
        "cwm",
        "data2vec-text",
        "dbrx",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "diffllama",
        "doge",
        "dots1",
        "dots3_note",
        "dots3_note_text",
        "electra",
        "emu3",
        "ernie",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone4",
        "exaone_moe",
        "falcon",
        "falcon_h1",
        "falcon_mamba",
        "flex_olmo",
        "flint",
        "fuyu",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gemma3n",
        "gemma3n_text",
        "gemma4",
        "gemma4_assistant",
        "gemma4_text",
        "gemma4_unified",
        "gemma4_unified_assistant",
        "gemma4_unified_text",
        "git",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "got_ocr2",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox",
        "gpt_neox_japanese",
        "gpt_oss",
        "gptj",
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoehybrid",
        "granitemoeshared",
        "helium",
        "hrm_text",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hy_v4",
        "hyperclovax",
        "inkling2_text",
        "inkling_text",
        "internlm3",
        "iquestcoder",
        "jais2",
        "jamba",
        "jetmoe",
        "kimi_linear",
        "kolibri1",
        "laguna",
        "lfm2",
        "lfm2_moe",
        "lfm3",
        "llama",
        "llama4",
        "llama4_text",
        "longcat_flash",
        "mamba",
        "mamba2",
        "marian",
        "mbart",
        "megatron-bert",
        "mellum",
        "mimo_v2_flash",
        "minicpm3",
        "minimax",
        "minimax_m2",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "mistral",
        "mixtral",
        "mllama",
        "modernbert-decoder",
        "moshi",
        "moss_transcribe_diarize",
        "mpt",
        "musicgen",
        "musicgen_melody",
        "mvp",
        "nanochat",
        "nemotron",
        "nemotron_h",
        "olmo",
        "olmo2",
        "olmo3",
        "olmo_hybrid",
        "olmoe",
        "openai-gpt",
        "opt",
        "pegasus",
        "persimmon",
        "phi",
        "phi3",
        "phi4_multimodal",
        "phimoe",
        "plbart",
        "prophetnet",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen4_exp",
        "qwen4_exp_text",
        "recurrent_gemma",
        "reformer",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "rwkv",
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "trocr",
        "vaultgemma",
        "whisper",
        "xglm",
        "xlm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xlnet",
        "xlstm",
        "xmod",
        "youtu",
        "zamba",
        "zamba2",
        "zaya",
    }
)


def _generate() -> None:  # pragma: no cover - maintenance helper
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    installed = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    print("types the installed transformers adds to KNOWN_CAUSAL_LM_TYPES:", sorted(installed - KNOWN_CAUSAL_LM_TYPES) or "none")
    print("types it no longer has:", sorted(KNOWN_CAUSAL_LM_TYPES - installed) or "none")


if __name__ == "__main__":  # pragma: no cover
    _generate()
