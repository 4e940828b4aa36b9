"""Tensor (and sequence) parallelism of a transformers causal LM, under FSDP2: the 2D layout.

The plan is the architecture's own (transformers' ``model.tp_plan``: the config's
``base_model_tp_plan`` under the base model's prefix, the head's ``_tp_plan``, and the input
embedding when the head is tied to it), applied through torch's ``parallelize_module`` on the
mesh's ``tensor_parallel`` dimension; then :func:`lmtrain.model.fsdp2.shard_fsdp2` shards every block
and the root over its ``data_parallel`` dimension. transformers' style names map onto torch's
parallel styles (verified on torch 2.13 CPU/gloo: losses within 1e-6 of one process):

- ``colwise`` -> ColwiseParallel (the output features split: q/k/v, gate/up);
- ``rowwise`` -> RowwiseParallel (the input features split, the outputs summed: o, down);
- ``colwise_gather_output`` -> ColwiseParallel with the output gathered (the LM head);
- ``embedding_rowwise`` -> RowwiseParallel of an embedding (the vocabulary split);
- ``rowwise_split_input`` -> RowwiseParallel whose replicated input is split first.

Other styles (packed MoE experts, replicated parameters with their own all-reduce) are refused
by :func:`problems`, at validate, with the layer named.

Sequence parallelism keeps the residual stream split along the sequence between the blocks'
matmuls: the norms run on each rank's slice (SequenceParallel), a column-parallel layer gathers
its input, a row-parallel one scatters its output. It needs every matmul of a block to be plain
column- or row-parallel, and explicit ``position_ids`` (:func:`position_ids`).

Traps this module owns (found on this machine kind, see DESIGN.md): tied embeddings become two
parameters once both ends are sharded, so they are tied again (:func:`parallelize`); the
gradient norm of parameters on two meshes is combined by :func:`clip_grad_norm_`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# transformers' style -> what it is, for messages
SUPPORTED = {
    "colwise": "column-parallel",
    "rowwise": "row-parallel",
    "colwise_gather_output": "column-parallel, output gathered",
    "embedding_rowwise": "vocabulary-parallel embedding",
    "rowwise_split_input": "row-parallel, input split",
}
# The styles sequence parallelism can keep the residual stream split across.
SEQUENCE_PARALLEL_STYLES = {"colwise", "rowwise", "embedding_rowwise"}


def model_plan(model: nn.Module) -> dict[str, str]:
    """The architecture's TP plan, full module paths (``*`` matches one layer index)."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    return dict(plan)


def problems(model: nn.Module, tp: int, *, sequence_parallel: bool = False, seq_len: int | None = None) -> list[str]:
    """Why ``model`` cannot be split over ``tp`` ranks: no plan, a style this runtime does not
    apply, heads (or KV heads) that ``tp`` does not divide; every factor in the message."""
    if tp <= 1:
        return []
    name = type(model.config).model_type if hasattr(type(model.config), "model_type") else type(model).__name__
    plan = model_plan(model)
    if not plan:
        return [f"model.type {name} has no tensor-parallel plan in transformers (its config has no "
                f"base_model_tp_plan): trainer.tensor_parallel_size({tp}) needs one; use tensor_parallel_size 1 "
                f"(FSDP2 alone) or an architecture with a plan (llama, mistral, qwen2, gemma, gemma2, phi3, ...)"]
    out = []
    odd = sorted({f"{layer} ({style})" for layer, style in plan.items() if style not in SUPPORTED})
    if odd:
        out.append(f"model.type {name}: lmlaunch cannot apply the tensor-parallel style of {', '.join(odd)} "
                   f"(it applies {', '.join(sorted(SUPPORTED))}); use tensor_parallel_size 1")
    cfg = model.config
    heads = _attr(cfg, ("num_attention_heads", "n_head", "num_heads"))
    kv = _attr(cfg, ("num_key_value_heads", "n_kv_heads")) or heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n is not None and n % tp:
            out.append(f"model.config.{what}({n}) is not divisible by trainer.tensor_parallel_size({tp}): "
                       f"each of the {tp} ranks of a tensor-parallel group holds {what} / {tp} heads")
    if sequence_parallel:
        inner = sorted({f"{layer} ({style})" for layer, style in plan.items()
                        if style not in SEQUENCE_PARALLEL_STYLES and not _is_head(model, layer)})
        if inner:
            out.append(f"trainer.sequence_parallel: model.type {name} has layers that are not plainly column- or "
                       f"row-parallel ({', '.join(inner)}), so the residual stream cannot stay split along the "
                       f"sequence; use sequence_parallel: false")
        outside = unplanned(model)
        if outside:
            out.append(f"trainer.sequence_parallel: model.type {name} has parameters outside its tensor-parallel "
                       f"plan ({', '.join(outside)}): they would see this rank's slice of the sequence as a "
                       f"distributed tensor and fail at the first step; use sequence_parallel: false (they are "
                       f"then kept whole on every rank of a tensor-parallel group)")
        if seq_len is not None and seq_len % tp:
            out.append(f"trainer.sequence_parallel: data.seq_len({seq_len}) is not divisible by "
                       f"trainer.tensor_parallel_size({tp}): each rank holds seq_len / {tp} positions")
    return out


def unplanned(model: nn.Module) -> list[str]:
    """The modules inside the transformer blocks that hold parameters of their own and that neither
    the plan nor sequence parallelism's norms cover (e.g. a mixture of experts whose plan, in newer
    transformers, lists only the attention), layer indices as ``*``."""
    import re

    from lmtrain.model.causal_lm import transformer_blocks

    patterns = [re.compile(re.escape(k).replace(r"\*", r"[^.]+") + r"(\.|$)") for k in model_plan(model)]
    covered = set(norms(model))
    blocks = {id(b) for b in transformer_blocks(model)}
    inside = [n for n, m in model.named_modules() if id(m) in blocks]
    out = set()
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)) or name in covered or _is_norm(module):
            continue
        if any(name.startswith(b + ".") for b in inside) and not any(rx.match(name) for rx in patterns):
            out.add(re.sub(r"\.\d+\.", ".*.", name))
    return sorted(out)


def check_split(model_spec: Any, split: Any) -> str:
    """ValueError with :func:`problems` of the model the spec builds (on the meta device: no
    memory) split as ``split`` (lmcore.job.spec.TensorSplit) says; else a note naming what the
    split keeps whole on every rank (parameters outside the plan), or ""."""
    from lmtrain.model.causal_lm import meta_model

    meta = meta_model(model_spec)
    found = problems(meta, split.size, sequence_parallel=split.sequence_parallel)
    if found:
        raise ValueError("; ".join(found))
    whole = unplanned(meta) if split.size > 1 else []
    if not whole:
        return ""
    return (f"tensor parallelism keeps {', '.join(whole)} whole on each of the {split.size} ranks of a "
            f"tensor-parallel group (outside transformers' plan for this model): their memory is not divided "
            f"by trainer.tensor_parallel_size")


def _attr(cfg: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int):
            return v
    return None


def _is_head(model: nn.Module, layer: str) -> bool:
    out = model.get_output_embeddings()
    return out is not None and model.get_submodule(layer) is out if "*" not in layer else False


def _styles(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    for layer, style in model_plan(model).items():
        if style == "colwise":
            plan[layer] = ColwiseParallel(input_layouts=seq)
        elif style == "rowwise":
            plan[layer] = RowwiseParallel(output_layouts=seq)
        elif style == "colwise_gather_output":
            plan[layer] = ColwiseParallel(input_layouts=seq if _is_head(model, layer) else Replicate(),
                                          output_layouts=Replicate())
        elif style == "embedding_rowwise":
            plan[layer] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif style == "rowwise_split_input":
            plan[layer] = RowwiseParallel(input_layouts=Replicate())
        else:
            raise RuntimeError(f"tensor-parallel style {style!r} of {layer} is not applied by lmtrain "
                               "(validate refuses it)")
    inp = model.get_input_embeddings()
    if sequence_parallel or _tied(model):
        # The embedding is split too: under sequence parallelism its output is the first split
        # residual stream; with tied weights both ends must be sharded alike (vocabulary rows).
        name = _name_of(model, inp)
        if name not in plan:
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if sequence_parallel:
        for name in norms(model):
            plan[name] = SequenceParallel()
    return plan


def _tied(model: nn.Module) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def norms(model: nn.Module) -> list[str]:
    """The norms on the residual stream: each block's own (direct children) and the final ones
    (direct children of the base model)."""
    from lmtrain.model.causal_lm import transformer_blocks

    blocks = set(map(id, transformer_blocks(model)))
    base = model.get_submodule(model.base_model_prefix) if model.base_model_prefix else model
    out = []
    for name, module in model.named_modules():
        if id(module) in blocks or module is base:
            out += [f"{name}.{child}" if name else child for child, m in module.named_children() if _is_norm(m)]
    return out


def split_dims(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> the dimension tensor parallelism splits it along (0: rows, 1: columns);
    parameters it keeps whole are absent. What :func:`parallelize` does, for the memory plan."""
    import re

    styles = dict(model_plan(model))
    inp = model.get_input_embeddings()
    if _tied(model):
        styles.setdefault(_name_of(model, inp), "embedding_rowwise")
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"[^.]+") + "$"), v) for k, v in styles.items()]
    out: dict[int, int] = {}
    for name, module in model.named_modules():
        style = next((v for rx, v in patterns if rx.match(name)), None)
        if style is None:
            continue
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if style.startswith("rowwise"):
            if weight is not None:
                out[id(weight)] = 1 if isinstance(module, nn.Linear) else 0
        else:  # colwise*, embedding_rowwise: output features (an embedding's vocabulary rows)
            for p in (weight, bias):
                if p is not None:
                    out[id(p)] = 0
    return out


def parallelize(model: nn.Module, mesh: Any, *, sequence_parallel: bool = False) -> None:
    """Split ``model`` over the 1-D tensor-parallel ``mesh`` in place; tied weights stay tied."""
    import logging

    from torch.distributed.tensor.parallel import parallelize_module

    # DTensor warns, once per rank, that the 2D gradient norm is reduced over the two mesh
    # dimensions one after the other; that is what clip_grad_norm_ wants (the norm of a few scalars)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    tied = _tied(model)
    parallelize_module(model, mesh, _styles(model, sequence_parallel))
    if tied:  # both ends were replaced by a DTensor each: one parameter again (same placements)
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        out.weight = inp.weight
        assert out.weight is inp.weight


def position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """0..T-1 for each row: under sequence parallelism the model sees only this rank's slice of
    the embeddings and would number the positions of the slice."""
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, across: Any = None,
                    uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters that live on several device meshes (2D:
    the TP-sharded ones on (dp, tp), the rest on (dp)): each mesh's norm separately, one total, every
    gradient scaled by it. Plain tensors (one process) form one more group. ``across``: a process
    group holding the rest of the model (a pipeline's other stages), whose squared norms are added.
    ``uncounted``: parameters whose gradient another rank of ``across`` counts already (a tied
    embedding's copy on the last stage, its gradient summed with the first stage's): scaled, left out
    of the norm, so that the norm is the one model's, as DDP's. The total norm, a plain tensor."""
    from torch.distributed.tensor import DTensor, Replicate

    skip = {id(p) for p in uncounted}
    groups: dict[Any, list[torch.Tensor]] = {}
    counted: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
            if id(p) not in skip:
                counted.setdefault(key, []).append(p)
    if not groups and across is None:
        return torch.zeros(())
    norms_ = [torch.zeros(())]
    for params in counted.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        norms_.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms_]))
    if across is not None:
        squared = total**2
        torch.distributed.all_reduce(squared, group=across)
        total = squared.sqrt()
    for mesh, params in groups.items():
        # each group's scale as a tensor of its own mesh (DTensor ops take no plain tensors)
        norm = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return total
