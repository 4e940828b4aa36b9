"""Pipeline stages of a transformers causal LM, run by ``torch.distributed.pipelining``.

Any decoder-only causal LM whose blocks form one list splits (:func:`find_parts` finds the decoder
stack, its blocks, what runs before them and the final norm after them, from the model's own
structure): GPT-2, GPT-NeoX, Phi, Gemma, Falcon, Llama and the others. A stage is a view of the
decoder stack with its own blocks, run by the stack's own forward: positions, rotary embeddings,
masks and per-layer attention types are computed as the whole model computes them. A stage after
the first hands the activation it received to its first block (the stack's work on it before the
blocks, the first stage's, is dropped); a stage before the last skips the final norm.

Parameters keep the whole model's names (``model.layers.5.mlp...``, ``transformer.h.3...``,
``lm_head.weight``): a checkpoint written by the stages (torch.distributed.checkpoint, one shard per
rank) holds the whole model under the names a one-stage run asks for, and reshards onto any
pipeline layout (pp2 -> pp1 -> pp2) as FSDP2's do. A head tied to the input embedding (GPT-2,
Gemma, Falcon) lives on the first and the last stage as two copies of one weight: their gradients
are summed after every backward over the two ranks (:func:`tied_group_of`), so both take the same
step, and the gradient norm counts the weight once.

Which layers a stage holds comes from :func:`lmcore.job.pipeline_stages.split_layers` (the dry
run shows the same map).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lmcore.job.pipeline_stages import SCHEDULES, StageMap, split_layers
from lmtrain.model.stack_parts import Parts, Unsplittable, find_parts


def problems(model: nn.Module, pipeline: int, schedule: str) -> list[str]:
    """Why ``model`` cannot be split into this pipeline (empty: it can)."""
    try:
        find_parts(model)
    except Unsplittable as exc:
        return [f"trainer.pipeline_parallel_size({pipeline}): {exc}; use trainer.pipeline_parallel_size 1"]
    return []


def stage_map(model: nn.Module, pipeline: int, schedule: str, explicit: list[int] | None = None) -> StageMap:
    """The planner's split of this model's layers (parameters: what runs before the blocks on the
    first stage, the final norm and the head on the last)."""
    parts = find_parts(model)
    stack = model.get_submodule(parts.stack_path)

    def count(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    costs = [count(layer) for layer in getattr(stack, parts.layers)]
    first = sum(count(stack.get_submodule(n)) for n in parts.before)
    last = sum(count(stack.get_submodule(n)) for n in parts.after) + count(model.get_submodule(parts.head))
    got = split_layers(costs, pipeline, schedule, first_extra=first, last_extra=last, explicit=explicit)
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


class StageLayers(nn.ModuleList):
    """A stage's blocks, registered under their index in the whole model (``layers.5``: the
    checkpoint holds the whole model's names), run in order by the stack's own forward. On a stage
    after the first, the first block takes the activation the previous stage sent (``incoming``)
    instead of what the stack computed before it from that activation (positions added, scaled,
    dropped out: the first stage's work)."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        nn.Module.__init__(self)
        for i, layer in layers.items():
            self.add_module(str(i), layer)
        self.incoming: torch.Tensor | None = None

    def _runnable(self) -> list[Any]:
        mods: list[Any] = list(self._modules.values())
        incoming = self.incoming
        if incoming is not None and mods:
            first = mods[0]

            def take_incoming(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                return first(incoming, *args, **kwargs)

            mods[0] = take_incoming
        return mods

    def __iter__(self) -> Iterator[Any]:
        return iter(self._runnable())

    def __getitem__(self, idx: Any) -> Any:
        return self._runnable()[idx]

    def __len__(self) -> int:
        return len(self._modules)


class _Zeros(nn.Module):
    """A stand-in for an embedding a later stage does not hold: zeros of its width, shaped as its
    first argument (the ids; OPT's learned positions take the attention mask, then more arguments)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, ids: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, device=ids.device)


class Stage(nn.Module):
    """One stage of the causal LM, its parameters under the whole model's names: a view of the
    decoder stack with this stage's blocks (and, on the first, what runs before them; on the last,
    the final norm), run by the stack's own forward, and the head on the last."""

    def __init__(self, lm: nn.Module, parts: Parts, index: int, layers: tuple[int, int], last: bool) -> None:
        super().__init__()
        stack = lm.get_submodule(parts.stack_path)
        self.config, self.parts = lm.config, parts
        self.first, self.last, self.lm_loss = index == 0, last, lm.loss_function
        view = copy.copy(stack)  # the same modules, its own children: what this stage runs
        view._modules = dict(stack._modules)
        view._parameters, view._buffers = dict(stack._parameters), dict(stack._buffers)
        blocks = getattr(stack, parts.layers)
        view._modules[parts.layers] = StageLayers({i: blocks[i] for i in range(*layers)})
        if not self.first:
            for name in parts.before:
                m = stack.get_submodule(name)
                view._modules[name] = _Zeros(m.embedding_dim) if isinstance(m, nn.Embedding) else nn.Identity()
        if not last:
            for name in parts.after:
                view._modules[name] = nn.Identity()
        view.config = _stage_config(stack.config, layers) if hasattr(stack, "config") else None
        self._set(parts.stack_path, view)
        self._whole: tuple[nn.Module, ...] = ()
        if last:
            self._set(parts.head, lm.get_submodule(parts.head))
            # the model's own forward around this stage's stack: what the causal LM does to the
            # head's logits (Gemma's final soft-capping, Cohere's logit_scale, Granite's
            # logits_scaling, ...) is done here as in the whole model. A tuple: its modules are this
            # stage's (registered above), not a second copy of them.
            self._whole = (_with_submodule(lm, parts.stack_path, view),)

    def _set(self, path: str, module: nn.Module) -> None:
        """``module`` at ``path`` (``model.decoder``: an empty ``model`` holds ``decoder``)."""
        owner: nn.Module = self
        *outer, name = path.split(".")
        for part in outer:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = self._whole[0] if self.last else self.get_submodule(self.parts.stack_path)
        if self.first:
            out = run(input_ids=x, use_cache=False)[0]
        else:
            layers = self.layers_module()
            layers.incoming = x
            try:
                out = run(inputs_embeds=x, use_cache=False)[0]
            finally:
                layers.incoming = None
        # a view (GPT-2's stack reshapes its output) cannot be detached in place, as the zero-bubble
        # schedules' split backward does with each stage's outputs: hand on a tensor of its own
        return out.clone() if out._is_view() else out

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The whole model's causal-LM loss (transformers shifts the labels inside)."""
        return self.lm_loss(logits=logits, labels=labels, vocab_size=self.config.vocab_size)

    def layers_module(self) -> StageLayers:
        return getattr(self.get_submodule(self.parts.stack_path), self.parts.layers)

    def blocks(self) -> list[nn.Module]:
        """This stage's blocks (the units FSDP2 shards)."""
        return list(self.layers_module()._modules.values())

    def tied_weight(self) -> nn.Parameter | None:
        """The embedding weight the head shares, as this stage holds it (first: the embedding's;
        last: the head's), when the model ties them; else None."""
        if not self.parts.tied:
            return None
        if self.last:
            return self.get_submodule(self.parts.head).weight
        if self.first:
            stack = self.get_submodule(self.parts.stack_path)
            return next(stack.get_submodule(n).weight for n in self.parts.before
                        if isinstance(stack.get_submodule(n), nn.Embedding))
        return None


def _with_submodule(root: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """A view of ``root`` with ``module`` at ``path`` (``model.decoder``): the same modules
    elsewhere, its own children along the path (``root`` itself unchanged)."""
    name, _, rest = path.partition(".")
    out = copy.copy(root)
    out._modules = dict(root._modules)
    out._modules[name] = _with_submodule(root._modules[name], rest, module) if rest else module  # type: ignore[arg-type]
    return out


def _stage_config(config: Any, layers: tuple[int, int]) -> Any:
    """The stack's config as a stage's forward reads it: the per-layer attention types of its own
    blocks (the stack indexes them by position in its list)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return config
    mine = copy.copy(config)
    mine.layer_types = list(types[layers[0]:layers[1]])
    return mine


def build_stages(lm: nn.Module, smap: StageMap, pipeline_rank: int) -> list[tuple[int, Stage]]:
    """This rank's stages (index, module), the rest of ``lm`` dropped with them."""
    last, parts = len(smap.layers) - 1, find_parts(lm)
    return [(s, Stage(lm, parts, s, smap.layers[s], s == last)) for s in smap.stages_of(pipeline_rank)]


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
                 schedule: str, microbatches: int, tied_group: Any = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        # a tied embedding and head: the first stage's and the last's copy of one weight, their
        # gradients summed after every backward (tied_group: this pipeline's first and last rank)
        self.tied = [w for _, m in modules if (w := m.tied_weight()) is not None]
        self.tied_group = tied_group
        if self.tied and tied_group is None:
            raise RuntimeError("a tied embedding and head on two pipeline stages needs the group of their ranks")
        # counted once in the gradient norm: the last stage's copy (the first stage's counts)
        self.duplicates = [m.tied_weight() for i, m in modules if i == n_stages - 1 and m.tied_weight() is not None]
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
        self._sum_tied_gradients()
        return torch.stack(losses).mean() if self.has_last and losses else None

    def _sum_tied_gradients(self) -> None:
        """The tied weight's gradient as one model has it: the embedding's part (first stage) plus
        the head's (last stage), on both copies, so that they take the same optimizer step."""
        from torch.distributed.tensor import DTensor

        for w in self.tied:
            grad = w.grad if w.grad is not None else torch.zeros_like(w)
            if w.grad is None:
                w.grad = grad
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            torch.distributed.all_reduce(local, group=self.tied_group)

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
    from lmtrain.model.fsdp2 import fsdp2_mixed_precision

    found = problems(lm, parallelism.pipeline, parallelism.schedule)
    found += tensor_parallel.problems(lm, parallelism.tensor)
    if found:
        raise RuntimeError("; ".join(found))
    if parallelism.tensor > 1:  # each block's matmuls over the tensor dimension, before the split (3D)
        tensor_parallel.parallelize(lm, mesh["tensor_parallel"], sequence_parallel=False)
    split = list(parallelism.split) if parallelism.split is not None else None
    smap = stage_map(lm, parallelism.pipeline, parallelism.schedule, split)
    pp_mesh = mesh["pipeline"]
    parts = find_parts(lm)
    tied_group = tied_group_of(mesh) if parts.tied else None  # collective: every rank, before the split
    mine = build_stages(lm, smap, pp_mesh.get_local_rank())
    _prune(lm, parts, mine)
    if parallelism.shards_stages:
        policy = fsdp2_mixed_precision(precision)
        kwargs: dict[str, Any] = {"mesh": mesh["data_parallel"]}
        if policy is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=policy[0], reduce_dtype=policy[1])
        for _, stage in mine:
            for layer in stage.blocks():
                fully_shard(layer, **kwargs)
            fully_shard(stage, **kwargs)
    return Pipeline(mine, len(smap.layers), pp_mesh.get_group(), device, parallelism.schedule, parallelism.microbatches,
                    tied_group=tied_group)


def tied_group_of(mesh: Any) -> Any:
    """Collective (every rank makes every group, in the same order): for each pipeline, the group of
    its first and last pipeline rank (stage 0 and the last stage, every schedule); this rank's, or
    None where it holds neither end."""
    import torch.distributed as dist

    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh
    pp = names.index("pipeline")
    pipes = ranks.movedim(pp, -1).reshape(-1, ranks.shape[pp]).tolist()
    me, mine = dist.get_rank(), None
    for row in pipes:
        group = dist.new_group(sorted({row[0], row[-1]}))
        if me in (row[0], row[-1]):
            mine = group
    return mine


def _prune(lm: nn.Module, parts: Parts, mine: list[tuple[int, Stage]]) -> None:
    """Keep in ``lm`` only what this rank's stages hold (the blocks under their whole-model index)."""
    stack = lm.get_submodule(parts.stack_path)
    stack._modules[parts.layers] = StageLayers({int(k): v for _, stage in mine
                                                for k, v in stage.layers_module()._modules.items()})
    if not any(stage.first for _, stage in mine):
        for name in parts.before:
            del stack._modules[name]
    if not any(stage.last for _, stage in mine):
        for name in parts.after:
            del stack._modules[name]
        del lm._modules[parts.head]
