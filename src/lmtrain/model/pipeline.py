"""Pipeline stages of a transformers causal LM, run by ``torch.distributed.pipelining``.

A stage is the causal LM with what it does not hold removed, so that its parameters keep the whole
model's names (``model.layers.5.mlp...``, ``lm_head.weight``): a checkpoint written by the stages
(torch.distributed.checkpoint, one shard per rank) holds the whole model under the names a
one-stage run asks for, and reshards onto any pipeline layout (pp2 -> pp1 -> pp2) as FSDP2's do.
The decoder layers become a ``ModuleDict`` keyed by their index in the whole model; every stage
computes the rotary position embeddings and the causal mask itself (they hold no parameters), and
passes them to each layer as the whole model's forward does.

Which layers a stage holds comes from :func:`lmcore.pipeline_stages.split_layers` (the dry
run shows the same map). The architectures split here are ``lmcore.pipeline_stages.SPLITTABLE``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmcore.pipeline_stages import SCHEDULES, SPLITTABLE, StageMap, split_layers


def problems(model: nn.Module, pipeline: int, schedule: str) -> list[str]:
    """Why ``model`` cannot be split into this pipeline (empty: it can)."""
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    if kind not in SPLITTABLE:
        return [f"model.type {kind}: its blocks cannot be split into pipeline stages by lmtrain (it splits "
                f"{', '.join(SPLITTABLE)}); use trainer.pipeline_parallel_size 1"]
    if getattr(config, "tie_word_embeddings", False):
        return ["model.config.tie_word_embeddings: the embedding (first stage) and the head (last stage) would be one "
                "tensor on two pipeline stages; set model.config.tie_word_embeddings: false for "
                f"trainer.pipeline_parallel_size({pipeline})"]
    return []


def stage_map(model: nn.Module, pipeline: int, schedule: str, explicit: list[int] | None = None) -> StageMap:
    """The planner's split of this model's layers (parameters: the embedding on the first stage,
    the norm and the head on the last)."""
    base = model.model
    costs = [sum(p.numel() for p in layer.parameters()) for layer in base.layers]
    first = sum(p.numel() for p in base.embed_tokens.parameters())
    last = sum(p.numel() for p in base.norm.parameters()) + sum(p.numel() for p in model.lm_head.parameters())
    got = split_layers(costs, pipeline, schedule, first_extra=first, last_extra=last, explicit=explicit)
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


class Stage(nn.Module):
    """One stage of the causal LM, its parameters under the whole model's names."""

    def __init__(self, lm: nn.Module, index: int, layers: tuple[int, int], last: bool) -> None:
        super().__init__()
        base = lm.model
        self.config = lm.config
        self.first, self.last, self.lm_loss = index == 0, last, lm.loss_function
        self.model = nn.Module()
        if self.first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in range(*layers)})
        self.model.rotary_emb = base.rotary_emb
        if last:
            self.model.norm = base.norm
            self.lm_head = lm.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.model.rotary_emb(h, position_ids=positions)
        masks = _masks(self.config, h, positions)
        for key, layer in self.model.layers.items():
            h = layer(h, attention_mask=masks[_layer_type(self.config, int(key))], position_ids=positions,
                      position_embeddings=rotary)
        if self.last:
            return self.lm_head(self.model.norm(h))
        return h

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The whole model's causal-LM loss (transformers shifts the labels inside)."""
        return self.lm_loss(logits=logits, labels=labels, vocab_size=self.config.vocab_size)


def _layer_type(config: Any, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[index])
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _masks(config: Any, h: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The masks the whole model's forward makes (None where attention is plainly causal)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = {"config": config, "inputs_embeds": h, "attention_mask": None, "position_ids": positions}
    try:
        full = create_causal_mask(**kwargs, cache=None)
        sliding = create_sliding_window_causal_mask(**kwargs, cache=None) if getattr(config, "sliding_window", None) else full
    except TypeError:  # transformers before the cache keyword's rename
        full = create_causal_mask(**kwargs, past_key_values=None)
        sliding = create_sliding_window_causal_mask(**kwargs, past_key_values=None) \
            if getattr(config, "sliding_window", None) else full
    return {"full_attention": full, "sliding_attention": sliding}


def build_stages(lm: nn.Module, smap: StageMap, pipeline_rank: int) -> list[tuple[int, Stage]]:
    """This rank's stages (index, module), the rest of ``lm`` dropped with them."""
    last = len(smap.layers) - 1
    return [(s, Stage(lm, s, smap.layers[s], s == last)) for s in smap.stages_of(pipeline_rank)]


def schedule_for(name: str, stages: list[Any], microbatches: int, loss_fn: Any) -> Any:
    """The torch.distributed.pipelining schedule ``name`` over this rank's PipelineStages."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, SCHEDULES[name][0])
    if SCHEDULES[name][1] == 1:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


class Pipeline:
    """This rank's stages and the schedule that runs them: ``step`` trains one global batch of a
    replica (its microbatches), returning the mean loss on the last stage's rank (None elsewhere)."""

    def __init__(self, modules: list[tuple[int, Stage]], n_stages: int, group: Any, device: torch.device,
                 schedule: str, microbatches: int) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.has_first = any(i == 0 for i, _ in modules)
        self.has_last = any(i == n_stages - 1 for i, _ in modules)
        self.stages = [PipelineStage(m, i, n_stages, device, group=group) for i, m in modules]
        last = next((m for i, m in modules if i == n_stages - 1), None)
        self.loss_fn = (lambda logits, labels: last.loss(logits, labels)) if last is not None else _no_loss
        self.schedule = schedule_for(schedule, self.stages, microbatches, self.loss_fn)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        self.schedule.step(*args, target=labels if self.has_last else None, losses=losses)
        return torch.stack(losses).mean() if self.has_last and losses else None

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses)
        return torch.stack(losses).mean() if self.has_last and losses else None


def _no_loss(*_: Any) -> torch.Tensor:
    raise RuntimeError("a pipeline rank without the last stage computed a loss")


def parallelize(lm: nn.Module, mesh: Any, parallelism: Any, precision: str, device: torch.device) -> Pipeline:
    """Split ``lm`` into this rank's stages (``mesh``: Lightning's device mesh with a ``pipeline``
    and a ``data_parallel`` dimension), shard each stage's layers and the stage itself with FSDP2
    over the data dimension when there are several replicas (torchtitan's order: blocks first, the
    stage as the root of its part), and prune ``lm`` to what this rank holds, under the whole
    model's names. Returns the pipeline that trains it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lmtrain.model import tensor_parallel
    from lmtrain.model.causal_lm import fsdp2_mixed_precision

    found = problems(lm, parallelism.pipeline, parallelism.schedule)
    found += tensor_parallel.problems(lm, parallelism.tensor)
    if found:
        raise RuntimeError("; ".join(found))
    if parallelism.tensor > 1:  # each block's matmuls over the tensor dimension, before the split (3D)
        tensor_parallel.parallelize(lm, mesh["tensor_parallel"], sequence_parallel=False)
    split = list(parallelism.split) if parallelism.split is not None else None
    smap = stage_map(lm, parallelism.pipeline, parallelism.schedule, split)
    pp_mesh = mesh["pipeline"]
    mine = build_stages(lm, smap, pp_mesh.get_local_rank())
    _prune(lm, mine)
    if parallelism.shards_stages:
        policy = fsdp2_mixed_precision(precision)
        kwargs: dict[str, Any] = {"mesh": mesh["data_parallel"]}
        if policy is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=policy[0], reduce_dtype=policy[1])
        for _, stage in mine:
            for layer in stage.model.layers.values():
                fully_shard(layer, **kwargs)
            fully_shard(stage, **kwargs)
    return Pipeline(mine, len(smap.layers), pp_mesh.get_group(), device, parallelism.schedule, parallelism.microbatches)


def _prune(lm: nn.Module, mine: list[tuple[int, Stage]]) -> None:
    """Keep in ``lm`` only what this rank's stages hold (the layers keyed by their whole-model index)."""
    base = lm.model
    base.layers = nn.ModuleDict({k: v for _, stage in mine for k, v in stage.model.layers.items()})
    if not any(stage.first for _, stage in mine):
        del base.embed_tokens
    if not any(stage.last for _, stage in mine):
        del base.norm
        del lm.lm_head
