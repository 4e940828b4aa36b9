"""A checkpoint of any strategy as a transformers model directory (``save_pretrained``) with
its tokenizer, so that ``AutoModelForCausalLM.from_pretrained(DIR)`` gives the trained model
and ``model.pretrained: DIR`` fine-tunes from it.

The weights come from :mod:`lmtrain.checkpoint.weights` (DDP file, FSDP2 DCP shards, ZeRO partitions, all
assembled on one CPU process); the architecture from the run's own plan (``plan.json``: the
model type and config overrides it trained with). The tokenizer is the one the run's data was
prepared with (``meta.json`` of ``data.path``): a transformers tokenizer directory is saved
again; lmlaunch's byte tokenizer (ids 0..255 = UTF-8 bytes, 256 = ``<eos>``) is written as a
``tokenizers`` byte-level tokenizer that gives the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lmcore.job.parallelism import Parallelism
from lmcore.run.checkpoint_index import CompleteCheckpoint
from lmtrain.checkpoint.weights import model_state_dict
from lmtrain.data.prepare.tokenizer import BYTE_EOS_ID, BYTE_VOCAB_SIZE
from lmtrain.model.causal_lm import build_config


def export_hf(plan: dict[str, Any], ckpt: CompleteCheckpoint, out_dir: str | Path) -> dict[str, Any]:
    """Write ``out_dir`` (config.json, model.safetensors, tokenizer files); return a summary."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    model_spec = plan["spec"]["model"]
    config = build_config(model_spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model_state_dict(ckpt.path)
    written = Parallelism.of_meta(ckpt.meta())
    expected = set(model.state_dict())
    # A tied output embedding is the input embedding: sharded checkpoints store it once.
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(expected - set(state) - tied)
    if missing:
        raise RuntimeError(f"{ckpt.path}: the checkpoint has no weights for {missing[:5]}")
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise RuntimeError(f"{ckpt.path}: weights {unexpected[:5]} do not belong to a {type(model).__name__}")
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    data = plan["spec"]["data"]
    data_path = data.get("path") or data["sources"][0]["path"]  # a mixture's stores share one tokenizer
    tokenizer = save_tokenizer(data_path, out)
    # the caller says each problem once, with the directory named (`lmlaunch export` does)
    tokenizer_problems = check_tokenizer(data_path, out, config.vocab_size)
    summary = {
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        "strategy": written.strategy,
        "tensor_parallel_size": written.tensor,  # the shards' layout, gathered whole
        "parallelism": written.describe(),
        "model_type": config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),  # a tied embedding once
        "tokenizer": tokenizer,
        "tokenizer_problems": tokenizer_problems,
        "out": str(out),
    }
    (out / "lmlaunch_export.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def save_tokenizer(data_path: str, out: Path) -> str:
    """Save the tokenizer the data was prepared with into ``out``; return its kind."""
    meta = json.loads((Path(data_path) / "meta.json").read_text())
    tok = meta.get("tokenizer") or {}
    if tok.get("kind") == "huggingface":
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tok["path"], local_files_only=True).save_pretrained(out)
        return "huggingface"
    byte_tokenizer().save_pretrained(out)
    return "bytes"


# What the exported tokenizer must encode as training did: ASCII, decomposed (NFD) accents,
# emoji and CJK, runs of whitespace, and a string other tokenizers treat as special.
PROBE_TEXTS = ("Plain ASCII text, with punctuation.", "cafe\u0301 d\u00e9ja\u0300 vu (NFD)",
               "emoji \U0001F600 and \u4e2d\u6587", "  two spaces,\ttab\nnewline  ", "<|endoftext|> done")


def check_tokenizer(data_path: str, out: Path, vocab_size: int) -> list[str]:
    """Load the exported tokenizer as a user would (``AutoTokenizer.from_pretrained(out)``) and
    compare its ids with the training tokenizer's on :data:`PROBE_TEXTS`: each difference, and
    any id outside the model's vocabulary, is a problem (with the loading line that does work).
    transformers picks the tokenizer class by model type for some types (qwen2, phi3, ...:
    its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), whatever the directory declares."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lmtrain.data.prepare.tokenizer import load_tokenizer

    meta = json.loads((Path(data_path) / "meta.json").read_text())
    tok = meta.get("tokenizer") or {}
    training = load_tokenizer(tok["path"] if tok.get("kind") == "huggingface" else None)
    problems = []
    for how, load in (("AutoTokenizer", AutoTokenizer.from_pretrained),
                      ("PreTrainedTokenizerFast", PreTrainedTokenizerFast.from_pretrained)):
        loaded = load(str(out))
        wrong = []
        for text in PROBE_TEXTS:
            got = list(loaded(text, add_special_tokens=False)["input_ids"])
            if got != training.encode(text) or any(not 0 <= i < vocab_size for i in got):
                wrong.append(text)
        if wrong:
            problems.append(f"{how}.from_pretrained(DIR) loads {type(loaded).__name__}, which encodes "
                            f"{', '.join(repr(t) for t in wrong)} other than training did"
                            + (" (load it with PreTrainedTokenizerFast.from_pretrained(DIR))"
                               if how == "AutoTokenizer" else ""))
    return problems


def byte_tokenizer():
    """lmlaunch's byte tokenizer as a transformers fast tokenizer: each UTF-8 byte is one token
    whose id is the byte's value, ``<eos>`` is 256, 257..259 are reserved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes, GPT-2's mapping
    by_byte = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(by_byte.values())
    vocab = {by_byte[b]: b for b in range(256)}
    vocab["<eos>"] = BYTE_EOS_ID
    for i in range(BYTE_EOS_ID + 1, BYTE_VOCAB_SIZE):
        vocab[f"<reserved_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # pad and unk name <eos> too: a tokenizer class that transformers forces by model type
    # (Qwen2Tokenizer) would otherwise add its own <|endoftext|> as id 260, outside the model
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": [f"<reserved_{i}>" for i in range(BYTE_EOS_ID + 1, BYTE_VOCAB_SIZE)]})
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
