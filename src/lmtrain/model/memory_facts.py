"""What the memory plan (launcher.planning.memory) needs to know about a model that only transformers
knows, found without allocating it:

- :func:`parameter_facts`: every parameter (tied ones once) in the order the optimizer and the
  engines see them, with its size, first dimension, rank and transformer block: what DDP, FSDP2
  (per-parameter dim-0 shards) and ZeRO (flat groups split at ranks, per-parameter partitions)
  hold of it on each rank.
- :func:`activation_trace`: the bytes one training forward saves for backward, traced with fake
  tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes, no memory, no arithmetic) for
  the run's micro batch, sequence length, precision, attention kernel and activation
  checkpointing. The same hooks that measure a real step (``saved_tensors_hooks``, each storage
  once, parameters excluded) count the fake one, so every architecture transformers builds is
  covered as it really runs, not by a formula per family. Two of transformers' decisions read
  tensor values and take their conservative branch under fake tensors (a materialised causal
  mask, key/value heads repeated for grouped-query attention); the trace gives them the values a
  training step has (no packed sequences, positions from 0), so it follows the real step's path.

On the CPU the trace is what the step saves, byte for byte (tests/unit/test_memory_estimate.py
measures real steps beside it). On a GPU, the kernels and autocast's casting rules are CUDA's:
PyTorch's flash and memory-efficient SDPA kernels save what its CPU flash kernel saves (query,
key, value, output, log-sum-exp) and apply attention dropout inside the kernel, where the CPU
falls back to the math kernel and saves the whole attention matrix: a trace for a GPU job
(``gpu_kernels``) runs SDPA as the flash kernel does, without the fallback. CUDA's autocast
casts a few more ops than the CPU's. How close the trace comes there is measured when a GPU is
lent (the GPU tests), not here.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lmcore.job.spec import ModelSpec
from lmtrain.model.causal_lm import (
    attention_for,
    build_config,
    checkpoint_activations,
    model_settings,
    transformer_blocks,
)

# How a precision computes (launcher.planning.memory.compute_mode): Lightning's mixed precision runs
# the fp32 model under autocast; DeepSpeed casts the model itself.
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def _fake_model(model_spec: ModelSpec | Mapping[str, Any], dtype: torch.dtype = torch.float32,
                checkpointing: bool = False) -> Iterator[tuple[nn.Module, Any]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    m = model_settings(model_spec)
    config = build_config(m)
    attn = attention_for(m, config)
    with FakeTensorMode(allow_non_fake_inputs=True), _training_step_masks():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
        if checkpointing:
            checkpoint_activations(model)  # as build_model does
        model.train()
        yield model, config


@contextlib.contextmanager
def _training_step_masks() -> Iterator[None]:
    """transformers' mask decisions as a training step makes them (see the module docstring)."""
    import transformers.masking_utils as masks
    from torch._subclasses.fake_tensor import FakeTensor

    from lmtrain.model.masks import not_packed

    ignore, packed = masks._ignore_causal_mask_sdpa, masks.find_packed_sequence_indices

    def ignore_causal(padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any,
                      *args: Any, **kwargs: Any) -> bool:
        def known(v: Any) -> Any:
            return 0 if isinstance(v, FakeTensor) else v  # a training step's positions start at 0

        return ignore(padding_mask, q_length, kv_length, known(q_offset), known(kv_offset), *args, **kwargs)

    masks._ignore_causal_mask_sdpa = ignore_causal
    masks.find_packed_sequence_indices = not_packed  # lmtrain never packs documents (lmtrain.model.masks)
    # Mixture-of-experts layers: torch's grouped_mm has a CUDA-only fake kernel (bf16 inputs only);
    # transformers' own fallback op (what it runs where grouped_mm cannot) has a fake kernel for any
    # dtype and saves the same tensors.
    moe: Any = importlib.import_module("transformers.integrations.moe")
    grouped = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a kernel without a fake implementation: the exception says it, once
    try:
        yield
    finally:
        masks._ignore_causal_mask_sdpa, masks.find_packed_sequence_indices = ignore, packed
        moe._can_use_grouped_mm = grouped
        quiet.setLevel(level)


@contextlib.contextmanager
def _flash_sdpa(on: bool) -> Iterator[None]:
    """SDPA as CUDA's flash kernel runs it: attention dropout inside the kernel (nothing more saved
    than without it), where the CPU would take its math kernel for any dropout."""
    if not on:
        yield
        return
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def flash(*args: Any, **kwargs: Any) -> Any:
        kwargs["dropout_p"] = 0.0
        if len(args) > 4:  # query, key, value, attn_mask, dropout_p, ...
            args = (*args[:4], 0.0, *args[5:])
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = flash  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]


def parameter_facts(model_spec: ModelSpec | Mapping[str, Any]) -> dict[str, Any]:
    """``params``: [numel, dim0, ndim, block] per parameter (block -1: outside every transformer
    block), in the order of ``model.parameters()`` with tied weights once; ``tp_dims``: the
    dimension tensor parallelism splits each along (-1: kept whole; lmtrain.model.tensor_parallel);
    ``blocks``; the config's ``vocab_size`` and ``eos_token_id`` (as a list: a config may name
    several)."""
    from lmtrain.model.causal_lm import meta_model
    from lmtrain.model.tensor_parallel import split_dims

    model = meta_model(model_spec)  # no memory and no initialisation
    config = model.config

    blocks = transformer_blocks(model)
    block_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    split = split_dims(model)
    params: list[list[int]] = []
    tp_dims: list[int] = []
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        params.append([p.numel(), int(p.shape[0]) if p.ndim else 1, p.ndim, block_of.get(id(p), -1)])
        tp_dims.append(split.get(id(p), -1))
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
    return {"params": params, "tp_dims": tp_dims, "blocks": len(blocks),
            "vocab_size": int(getattr(config, "vocab_size", 0) or 0), "eos_token_ids": eos_ids,
            "tied_head": _tied_head(model), "positions": positions(model)}


def positions(model: Any) -> dict[str, Any]:
    """How long a sequence the model takes: ``learned``, the rows of a learned position table
    (GPT-2's ``wpe``, OPT's ``embed_positions`` less its offset; a longer sequence indexes past it),
    else None (rotary, ALiBi: any length runs); ``configured``, the config's maximum, and ``key``,
    the config key that sets it (``n_positions`` for GPT-2), or None when the config has none."""
    import torch

    config = model.config
    key = getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
    configured = getattr(config, key, None)
    embed = model.get_input_embeddings()
    learned = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding) or module is embed:
            continue
        rows = int(module.num_embeddings) - int(getattr(module, "offset", 0) or 0)
        last = name.rsplit(".", 1)[-1]
        if rows == configured or "pos" in last or last == "wpe":  # GPT-2's and GPT-Neo's table is `wpe`
            learned = rows
            break
    return {"learned": learned, "configured": int(configured) if isinstance(configured, int) else None,
            "key": key if isinstance(configured, int) else None}


def _tied_head(model: Any) -> int:
    """The index (in ``params``) of the input embedding's weight when the head shares it, else -1:
    a pipeline's last stage holds a copy of it (lmtrain.model.pipeline)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(embed, "weight", None)
    if head is None or weight is None or getattr(head, "weight", None) is not weight:
        return -1
    unique: list[Any] = []
    for p in model.parameters():
        if p.requires_grad and not any(p is q for q in unique):
            unique.append(p)
    return next((i for i, p in enumerate(unique) if p is weight), -1)


def activation_trace(model_spec: ModelSpec | Mapping[str, Any], *, micro_batch: int, seq_len: int,
                     compute: str, checkpointing: bool, gpu_kernels: bool = False) -> dict[str, int]:
    """Bytes saved for backward by one training forward (each storage once, parameters and the
    autocast copies of them included, the parameters themselves not): ``saved`` in all, ``head``
    of it from the output layer on (logits and loss). ``compute``: ``autocast-bf16``,
    ``autocast-fp16`` (an fp32 model under autocast), ``bf16``, ``fp16`` (the model cast), ``fp32``."""
    autocast = compute.startswith("autocast-")
    dtype = torch.float32 if autocast else _DTYPES[compute]
    with _fake_model(model_spec, dtype, checkpointing) as (model, config):
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        saved: dict[int, int] = {}
        in_head: dict[int, bool] = {}
        state = {"head": False}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in params and key not in saved:
                saved[key] = t.untyped_storage().nbytes()
                in_head[key] = state["head"]
            return t

        head = model.get_output_embeddings()
        hook = head.register_forward_pre_hook(lambda *_: state.update(head=True)) if head is not None else None
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        cast = (torch.autocast("cpu", dtype=_DTYPES[compute.removeprefix("autocast-")]) if autocast
                else contextlib.nullcontext())
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast, _flash_sdpa(gpu_kernels):
                model(input_ids=ids, labels=ids, use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
    return {"saved": sum(saved.values()), "head": sum(n for k, n in saved.items() if in_head[k])}
