"""The causal language model: a transformers model built from the spec's ``model`` section.

Two sources (the spec enforces exactly one):

- ``model.type`` + ``model.config``: ``AutoConfig.for_model(type, **overrides)`` initialised
  from scratch with the run's seed (GPT-2, Llama, Mistral, ... any causal LM type);
- ``model.pretrained``: a local directory (config.json + weights), loaded with
  ``local_files_only=True``: nothing is fetched from the network at run time.

FLOPs per token (for MFU), the PaLM/nanoGPT convention, counting model FLOPs only (the
recomputation of activation checkpointing is not counted)::

    flops_per_token = 6 * N + 12 * L * d * T

N counts the parameters in a matmul per token: every one with ndim >= 2 but pure lookup
embeddings (a token embedding tied to the output head counts: the head is a d x vocab matmul;
position embeddings never do). 6N is forward (2N) + backward (4N); 12*L*d*T the attention's
QK^T and AV matmuls (2 * 2 * d * T per layer forward, x3 with backward), L layers of width d,
sequence length T.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmcore.job.spec import ModelSpec

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


def model_settings(model_spec: ModelSpec | Mapping[str, Any]) -> ModelSpec:
    """The spec's ``model`` section, typed (a section given as a dict is validated again)."""
    return model_spec if isinstance(model_spec, ModelSpec) else ModelSpec.model_validate(dict(model_spec))


def build_config(model_spec: ModelSpec | Mapping[str, Any]) -> Any:
    """A transformers config from ``model.type`` + overrides, or the pretrained dir's config;
    ValueError when its special token ids fall outside its vocabulary."""
    from transformers import AutoConfig

    m = model_settings(model_spec)
    overrides = dict(m.config)
    if m.pretrained:
        config = AutoConfig.from_pretrained(m.pretrained, local_files_only=True, **overrides)
    else:
        config = AutoConfig.for_model(m.type, **overrides)
    check_token_ids(config, overrides, m.type or m.pretrained)
    return config


TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def check_token_ids(config: Any, overrides: dict[str, Any], source: Any) -> None:
    """``pad_token_id`` inside ``vocab_size`` (ValueError otherwise): a default of the architecture
    (phi3's 32000) meets a small vocabulary set by the spec, and the embedding's padding row fails
    later naming no setting. The error names the key, where its value came from, and what to set.
    bos/eos ids outside the vocabulary are only logged: training never indexes with them (GPT-2's
    default 50256 with a small vocabulary trains as before), ``generate`` on an export would."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for key in TOKEN_ID_KEYS:
        value = getattr(config, key, None)
        ids = value if isinstance(value, list) else [value]
        bad = [i for i in ids if isinstance(i, int) and not 0 <= i < vocab]
        if not bad:
            continue
        origin = "set in model.config" if key in overrides else f"the default of {source}"
        what = (f"model.config.{key} is {value} ({origin}), outside the vocabulary: vocab_size is {vocab}, "
                f"so ids must be 0..{vocab - 1}; set model.config.{key} to an id below {vocab} (or null), "
                f"or model.config.vocab_size above {max(bad)}")
        if key == "pad_token_id":
            raise ValueError(what)
        log.warning("%s (generate on an export would fail)", what)


def attention_for(model_spec: ModelSpec | Mapping[str, Any], config: Any) -> str:
    """The attention kernel to build with: ``auto`` (or unset) is sdpa where the architecture
    supports it, else eager; an explicit kernel the architecture does not support is a ValueError
    naming the setting (transformers' own error names none)."""
    from transformers import AutoModelForCausalLM

    wanted = model_settings(model_spec).attn_implementation
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{type(config).__name__} ({config.model_type}) is not a causal language model "
                         "transformers can build (AutoModelForCausalLM)") from None
    supports = {"sdpa": bool(getattr(model_class, "_supports_sdpa", False)),
                "flash_attention_2": bool(getattr(model_class, "_supports_flash_attn", False)
                                          or getattr(model_class, "_supports_flash_attn_2", False)),
                "eager": True}
    if wanted == "auto":
        return "sdpa" if supports["sdpa"] else "eager"
    if not supports.get(wanted, False):
        usable = ", ".join(k for k, ok in supports.items() if ok)
        raise ValueError(
            f"model.attn_implementation is {wanted}, which {model_class.__name__} does not support; "
            f"use auto or one of: {usable}"
        )
    return wanted


def check_model_spec(model_spec: ModelSpec | Mapping[str, Any]) -> None:
    """What building the model checks, without building it: the config with its special token ids
    (:func:`build_config`), the attention kernel (:func:`attention_for`) and the construction
    itself on the meta device (no memory: a size the architecture cannot take fails here, in
    transformers' words, naming the model section). ValueError, naming the setting.
    (:func:`lmtrain.model.tensor_parallel.check_split` checks a tensor-parallel split of it.)"""
    from transformers import AutoModelForCausalLM

    try:
        config = build_config(model_spec)
    except ValueError as exc:
        if str(exc).startswith("model."):  # ours, naming the setting
            raise
        raise ValueError(f"model.config: transformers refuses it: {exc}") from exc
    except Exception as exc:  # transformers' config validation, whatever its type
        raise ValueError(f"model.config: transformers refuses it: {type(exc).__name__}: {exc}") from exc
    attn = attention_for(model_spec, config)
    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    except Exception as exc:  # transformers' own error, whatever its type
        raise ValueError(f"model.config: transformers cannot build {type(config).__name__} with it: "
                         f"{type(exc).__name__}: {exc}") from exc
    params = sum(p.numel() for p in meta.parameters())
    if params <= STEP_CHECK_PARAMS:
        _check_one_step(config, attn, params)


# A model up to this size also takes one training step on the CPU when its section is checked
# (a fraction of a second): sizes that build but disagree in the forward (a rotary_dim wider than
# a head, MLA ranks against the heads) fail there, not on the allocation. Larger models are
# checked up to their construction.
STEP_CHECK_PARAMS = 20_000_000


def _check_one_step(config: Any, attn: str, params: int) -> None:
    from transformers import AutoModelForCausalLM

    tokens = 8
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random streams are left as they were
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
            ids = torch.zeros(1, tokens, dtype=torch.long)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    except Exception as exc:  # transformers' or torch's error, whatever its type
        raise ValueError(
            f"model.config: {type(config).__name__} builds but its first training step fails (checked on the "
            f"CPU with {tokens} tokens, {params:,} parameters): {type(exc).__name__}: {exc}") from exc


def meta_model(model_spec: ModelSpec | Mapping[str, Any]) -> nn.Module:
    """The model the spec builds, on the meta device: its modules and shapes, no memory, no init."""
    from transformers import AutoModelForCausalLM

    m = model_settings(model_spec)
    config = build_config(m)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(m, config),
                                                dtype=torch.float32)


def parameter_count(model_spec: ModelSpec | Mapping[str, Any]) -> tuple[int, int]:
    """(parameters, vocab size) of the model the spec builds, without allocating it (meta device)."""
    model = meta_model(model_spec)
    return sum(p.numel() for p in model.parameters()), int(getattr(model.config, "vocab_size", 0) or 0)


def build_model(model_spec: ModelSpec | Mapping[str, Any], *, seed: int) -> nn.Module:
    """The causal LM, in fp32 on the current default device (Lightning/DeepSpeed move and cast it).

    Called inside ``LightningModule.configure_model`` so that DeepSpeed ZeRO-3 (``zero.Init``) and
    FSDP can shard parameters as they are created instead of materialising the full model on
    every rank.
    """
    from transformers import AutoModelForCausalLM

    m = model_settings(model_spec)
    config = build_config(m)
    attn = attention_for(m, config)
    torch.manual_seed(seed)  # same initial weights on every rank and every attempt
    if m.pretrained:
        model = AutoModelForCausalLM.from_pretrained(
            m.pretrained,
            config=config,
            local_files_only=True,
            attn_implementation=attn,
            dtype=torch.float32,
        )
    else:
        with _weights_initialised_later():
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
        # the init's random stream starts here, whatever building the layers drew (zero.Init draws
        # otherwise): ZeRO-3's partitioned model starts as every other strategy's
        torch.manual_seed(seed)
        _init_weights(model, zero3=_under_zero3_init())
    if m.activation_checkpointing:
        checkpoint_activations(model)
    return model


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each block's activations in backward. Non-reentrant checkpointing works with
    DDP, FSDP, ZeRO-3 and torch.compile."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False


def _under_zero3_init() -> bool:
    """Inside DeepSpeed ZeRO-3's ``zero.Init`` (Lightning enters it around configure_model): every
    parameter becomes a partition as soon as its module is built."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return bool(getattr(zero, "zero_init_context", 0))


@contextlib.contextmanager
def _weights_initialised_later():
    """transformers' weight init after construction skipped (weights are still tied): under
    ``zero.Init`` it would run on each rank's empty partitions, where indexing a row fails (the
    padding row of an embedding with a ``padding_idx``: IndexError, for every architecture with a
    pad token). :func:`_init_weights` runs it afterwards (on gathered parameters under ZeRO-3). PyTorch's
    own initialisation in each layer's constructor still runs on the full tensors."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.init_weights

    def tie_only(self: Any) -> None:
        self.tie_weights(recompute_mapping=False)

    PreTrainedModel.init_weights = tie_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original  # type: ignore[method-assign]


def _init_weights(model: nn.Module, *, zero3: bool) -> None:
    """transformers' weight init of a model built with it deferred (:func:`_weights_initialised_later`),
    in its own order (each module after its children). Under ZeRO-3 the parameters were partitioned
    as they were built: transformers' ZeRO-3 init gathers each module's, rank 0 initialises them
    from the seeded stream (the same draws in the same order as the plain init) and they are
    partitioned again. Without the deferral the init would have run on the empty partitions and
    done nothing (PyTorch's layer defaults: a loss of ~80, not ln(vocab))."""
    for module in model.modules():
        module._is_hf_initialized = False
    for p in (p for p in model.parameters() if getattr(p, "_is_hf_initialized", False)):
        p._is_hf_initialized = False
    if zero3:
        from transformers.integrations.deepspeed import initialize_weights_zero3

        initialize_weights_zero3(model)
    else:
        model.initialize_weights()  # type: ignore[operator]
    model.tie_weights()  # type: ignore[operator]


def compile_model(model: nn.Module, *, loss: bool = True) -> nn.Module:
    """Compile each transformer block in place, as torchtitan does: one small graph reused by every
    layer, nothing for DDP's optimizer to split at its buckets (pytorch#108966); FSDP2 and TP apply
    afterwards (compilation is lazy). In place, parameter names keep no ``_orig_mod.`` prefix:
    checkpoints with and without compile are interchangeable. No blocks found: the whole model.

    ``loss``: transformers' ``loss_function`` too (eager, fp32 copies of GPT-2's logits at 16 x 1024:
    3.3 GB each, 8.8 ms of an H100's 59 ms step); not where logits are split or a stage owns it."""
    try:
        blocks = transformer_blocks(model)
    except RuntimeError:
        model.compile()
        return model
    for block in blocks:
        block.compile()
    if loss and hasattr(model, "loss_function"):
        model.loss_function = torch.compile(model.loss_function)
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
        if _ndim(p) >= 2 and id(p) not in lookup_ids:
            matmul += n
    return ModelShape(n_layer=int(n_layer), d_model=int(d_model), matmul_params=matmul, total_params=total)


def _numel(p: torch.Tensor) -> int:
    # ZeRO-3 partitions parameters to shape (0,); ds_numel is the full size.
    return int(getattr(p, "ds_numel", p.numel()))


def _ndim(p: torch.Tensor) -> int:
    # ZeRO-3's partitioned (0,) placeholder has one dimension; ds_shape is the full shape.
    return len(getattr(p, "ds_shape", p.shape))


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
