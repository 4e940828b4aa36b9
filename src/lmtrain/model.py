"""The causal language model: a transformers model built from the spec's ``model`` section.

Two sources (the spec enforces exactly one):

- ``model.type`` + ``model.config``: ``AutoConfig.for_model(type, **overrides)`` initialised
  from scratch with the run's seed (GPT-2, Llama, Mistral, ... any causal LM type);
- ``model.pretrained``: a local directory (config.json + weights), loaded with
  ``local_files_only=True``: nothing is fetched from the network at run time.

FLOPs per token (for MFU), the PaLM/nanoGPT convention, counting model FLOPs only (the
recomputation of activation checkpointing is not counted)::

    flops_per_token = 6 * N + 12 * L * d * T

N is the number of parameters that take part in a matmul per token: every parameter with
ndim >= 2 except input embeddings that are pure lookups (the token embedding counts when it
is tied to the output head, because the head is a (d x vocab) matmul; position embeddings never
count). 6N is forward (2N) + backward (4N); 12*L*d*T is the attention score and value matmuls
(QK^T and AV: 2 * 2 * d * T per layer forward, times 3 for forward + backward) for L layers of
width d at sequence length T.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """What MFU needs to know about a model."""

    n_layer: int
    d_model: int
    matmul_params: int
    total_params: int

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.matmul_params + 12.0 * self.n_layer * self.d_model * seq_len


def _config_overrides(model_spec: dict[str, Any]) -> dict[str, Any]:
    return dict(model_spec.get("config") or {})


def build_config(model_spec: dict[str, Any]):
    """A transformers config from ``model.type`` + overrides, or the pretrained dir's config."""
    from transformers import AutoConfig

    overrides = _config_overrides(model_spec)
    if model_spec.get("pretrained"):
        return AutoConfig.from_pretrained(model_spec["pretrained"], local_files_only=True, **overrides)
    return AutoConfig.for_model(model_spec["type"], **overrides)


def parameter_count(model_spec: dict[str, Any]) -> tuple[int, int]:
    """(parameters, vocab size) of the model the spec builds, without allocating it (meta device)."""
    from transformers import AutoModelForCausalLM

    config = build_config(model_spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), int(getattr(config, "vocab_size", 0) or 0)


def build_model(model_spec: dict[str, Any], *, seed: int) -> nn.Module:
    """The causal LM, in fp32 on the current default device (Lightning/DeepSpeed move and cast it).

    Called inside ``LightningModule.configure_model`` so that DeepSpeed ZeRO-3 (``zero.Init``) and
    FSDP can shard parameters as they are created instead of materialising the full model on
    every rank.
    """
    from transformers import AutoModelForCausalLM

    attn = model_spec.get("attn_implementation") or "sdpa"
    config = build_config(model_spec)
    torch.manual_seed(seed)  # same initial weights on every rank and every attempt
    if model_spec.get("pretrained"):
        model = AutoModelForCausalLM.from_pretrained(
            model_spec["pretrained"],
            config=config,
            local_files_only=True,
            attn_implementation=attn,
            dtype=torch.float32,
        )
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
        if _zero3_partitioned(model):
            _init_zero3_weights(model)
    if model_spec.get("activation_checkpointing"):
        # Non-reentrant checkpointing works with DDP, FSDP, ZeRO-3 and torch.compile.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False
    return model


def _zero3_partitioned(model: nn.Module) -> bool:
    """Built under DeepSpeed ZeRO-3's ``zero.Init`` (Lightning enters it around configure_model):
    every parameter is already a partition (``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _init_zero3_weights(model: nn.Module) -> None:
    """Initialise a model whose parameters ZeRO-3 partitioned while it was built.

    transformers initialises weights after construction; under a ``zero.Init`` it did not enter
    itself, that init ran on the empty partitions and did nothing (the weights kept PyTorch's
    layer defaults: a loss of ~80 instead of ln(vocab)), and it marked every module initialised.
    Clear the marks and run transformers' ZeRO-3 initialisation: each module's parameters are
    gathered, rank 0 initialises them from the seeded RNG (the same stream, in the same order,
    as the unpartitioned model's init) and they are partitioned again."""
    from transformers.integrations.deepspeed import initialize_weights_zero3

    for module in model.modules():
        module._is_hf_initialized = False
    for p in model.parameters():
        if getattr(p, "_is_hf_initialized", False):
            p._is_hf_initialized = False
    initialize_weights_zero3(model)
    model.tie_weights()


def compile_model(model: nn.Module) -> nn.Module:
    """Compile the transformer in place (``nn.Module.compile``).

    In-place compilation keeps the parameter names (no ``_orig_mod.`` prefix), so checkpoints
    written with and without compile are interchangeable; DDP/FSDP/DeepSpeed wrap the
    LightningModule around the compiled transformer.
    """
    model.compile()
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model (the classes it names in
    ``_no_split_modules``): the units FSDP shards and gathers one at a time."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise RuntimeError(
            f"cannot find the transformer blocks of {type(model).__name__} "
            f"(_no_split_modules: {sorted(names) or 'none'}) to shard with FSDP"
        )
    return blocks


def shard_fsdp2(model: nn.Module, mesh: Any) -> None:
    """FSDP2: shard each transformer block, then the root (embeddings, final norm, head), over
    ``mesh`` (the data-parallel mesh). Each block's parameters are gathered just before its
    forward/backward and freed after; the root's group holds what no block owns."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def model_shape(model: nn.Module) -> ModelShape:
    cfg = model.config
    n_layer = _first_attr(cfg, ("num_hidden_layers", "n_layer", "num_layers"))
    d_model = _first_attr(cfg, ("hidden_size", "n_embd", "d_model"))
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    lookup_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            if tied and module is inp:
                continue  # the tied embedding is also the output matmul
            lookup_ids.add(id(module.weight))
    seen: set[int] = set()
    matmul = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = _numel(p)
        total += n
        if p.ndim >= 2 and id(p) not in lookup_ids:
            matmul += n
    return ModelShape(n_layer=int(n_layer), d_model=int(d_model), matmul_params=matmul, total_params=total)


def _numel(p: torch.Tensor) -> int:
    # ZeRO-3 partitions parameters to shape (0,); ds_numel is the full size.
    return int(getattr(p, "ds_numel", p.numel()))


def _first_attr(cfg: Any, names: tuple[str, ...]) -> int:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    raise ValueError(f"model config {type(cfg).__name__} has none of {', '.join(names)}")


# Dense peak FLOP/s per device for MFU, by precision. Only hardware we can name exactly;
# unknown devices (and CPUs) report MFU as null rather than a guess.
_PEAK_FLOPS = {
    "H100 80GB HBM3": {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12},  # SXM: 1979 sparse / 2
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "H200": {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12},  # same tensor cores as H100 SXM
    "A100-SXM4-80GB": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A100-SXM4-40GB": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A100 80GB PCIe": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
}


def peak_flops_per_device(precision: str) -> float | None:
    """Dense peak FLOP/s of this process's CUDA device for the precision, or None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    kind = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
    for key, table in _PEAK_FLOPS.items():
        if key in name:
            return table[kind]
    return None
