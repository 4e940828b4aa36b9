"""Per-rank memory of a training job, planned before queue time (pure: no torch, no I/O).

The model's facts (every parameter's size, first dimension, rank and block; the bytes a forward saves,
traced) come from lmtrain.model.memory_facts; with the plan, :func:`estimate` gives one rank's:

- **parameters, gradients, optimizer states** exactly as the engines hold them (the ledger's
  ``memory`` line counts the same tensors in the running job; tests/unit/test_memory_estimate.py
  holds the two within 1 % for every strategy on 1, 2 and 4 ranks):
  DDP keeps everything whole (fp32 weights under Lightning's mixed precision, gradients in the
  DDP buckets, AdamW's two fp32 moments); FSDP2 keeps each parameter's dim-0 shard, padded to
  the same rows on every rank, and its gradient and moments alike; DeepSpeed casts the weights to
  the compute dtype, keeps fp32 master weights and moments for its partition, and ZeRO 1/2 split
  each optimizer group's flat buffer (padded to 2 x ranks elements) at rank boundaries, holding
  whole the gradients of every parameter that crosses into the rank's part (ZeRO-1 with gradient
  accumulation keeps every gradient whole between optimizer steps); ZeRO-3 partitions every
  parameter (ceil(numel / ranks) each).
- **activations** and **logits and loss**: what the forward saves for backward (traced), and the
  logits' gradient (:func:`_logits_row`: eager, or a compiled loss).
- **recomputed block** (activation checkpointing): one block's activations rebuilt in backward.
- **communication buffers**: DeepSpeed's gradient reduction buckets (``reduce_bucket_size``
  elements, two with ``overlap_comm``; fp32 under ZeRO-1), FSDP2's gathered root and blocks,
  ZeRO-3's gathered blocks and persistent small parameters. **cuBLAS workspaces** (GPU jobs): PyTorch's.
  **framework** (GPU jobs): the CUDA context and NCCL's buffers, outside the caching allocator.

A GPU job fits when its peak is within :data:`USABLE_FRACTION` of the profile's ``gpu_memory``: the
caching allocator holds 5-10 % more than is allocated in training (fragmentation); the margin is 10 %.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lmcore.job.parallelism import Parallelism

GB = 1e9
USABLE_FRACTION = 0.90
FRAMEWORK_BYTES = int(1.5 * (1 << 30))  # CUDA context (~0.5 GiB), cuBLAS workspaces, NCCL buffers (~1 GiB)
# PyTorch's cuBLAS workspaces, from its caching allocator (so in max_memory_allocated): one per thread, forward's
# and autograd's backward's, 32 MiB each on Hopper and later (8 MiB before; CUBLAS_WORKSPACE_CONFIG)
CUBLAS_WORKSPACES = 2 * 32 * (1 << 20)
ZERO3_PERSISTENCE = 100_000  # launcher.planning.deepspeed_config's stage3_param_persistence_threshold
_PRECISION_KIND = {"bf16-mixed": "bf16", "16-mixed": "fp16", "32-true": "fp32"}
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelFacts:
    """What only transformers knows (lmtrain.model.memory_facts): ``params`` as (numel, dim0, ndim,
    block) with block -1 outside the transformer blocks; ``traces[(compute, checkpointing)]`` =
    (saved, head) bytes at micro batch 1 and 2, for ``seq_len``."""

    params: tuple[tuple[int, int, int, int], ...]
    blocks: int
    vocab_size: int
    seq_len: int
    traces: Mapping[tuple[str, bool], tuple[int, int, int, int]]
    tp_dims: tuple[int, ...] = ()  # per parameter: the dimension tensor parallelism splits (-1: none)
    eos_token_ids: tuple[int, ...] = ()  # the config's eos_token_id (one or several; none when unset)
    tied_head: int = -1  # params index of the embedding weight the head shares (-1: untied)
    positions: Mapping[str, Any] = field(default_factory=dict)  # lmtrain.model.memory_facts.positions

    def split_dim(self, i: int) -> int:
        return self.tp_dims[i] if i < len(self.tp_dims) else -1

    @property
    def total(self) -> int:
        return sum(p[0] for p in self.params)


@dataclass(frozen=True)
class Setup:
    """The settings the memory depends on (from the plan; the fixes change them)."""

    parallelism: Parallelism
    offload_optimizer: bool
    offload_params: bool
    precision: str
    micro_batch: int
    global_batch: int
    checkpointing: bool
    gpu: bool
    reduce_bucket: int = 500_000_000
    overlap_comm: bool = True
    compiled: bool = False  # model.compile (the loss too where Parallelism.compiles_loss)

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def zero_stage(self) -> int | None:
        return self.parallelism.zero_stage

    @property
    def tensor_parallel(self) -> int:  # FSDP2 x TP: each model replica split over this many ranks
        return self.parallelism.tensor

    @property
    def sequence_parallel(self) -> bool:
        return self.parallelism.sequence_parallel

    @property
    def data_parallel(self) -> int:
        return self.parallelism.data_parallel_size

    def on(self, parallelism: Parallelism) -> Setup:
        return replace(self, parallelism=parallelism)

    @property
    def accumulation(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.data_parallel))


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int
    how: str


@dataclass(frozen=True)
class Breakdown:
    rows: tuple[Row, ...]
    capacity: int | None  # the GPU's memory (None: not a GPU job, or the profile does not say)

    @property
    def peak(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def usable(self) -> int | None:
        return None if self.capacity is None else int(self.capacity * USABLE_FRACTION)

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.peak <= self.usable

    def to_json(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "peak": self.peak, "capacity": self.capacity,
                "usable": self.usable, "fits": self.fits}


def compute_mode(parallelism: Parallelism, precision: str) -> str:
    """How the forward computes (:meth:`Parallelism.compute_mode`) at a Lightning precision."""
    return parallelism.compute_mode(_PRECISION_KIND[precision])


def _groups(params: Sequence[tuple[int, int, int, int]]) -> list[list[int]]:
    """lmtrain.model.module.param_groups: matrices and embeddings (decayed), then 1-D tensors."""
    return [[p[0] for p in params if p[2] >= 2], [p[0] for p in params if p[2] < 2]]


def _zero12(sizes: list[list[int]], world: int) -> tuple[int, int, int]:
    """(padded elements of all groups, this rank's part of them, the most gradient elements any
    rank holds): DeepSpeed's stage_1_and_2 partitioning."""
    padded_all, part_all, grads = 0, 0, [0] * world
    for group in sizes:
        n = sum(group)
        padded = math.ceil(n / (2 * world)) * 2 * world if n else 0
        part, start = padded // world, 0
        padded_all, part_all = padded_all + padded, part_all + part
        for numel in group:
            end = start + numel
            for r in range(start // part if part else 0, min(world, math.ceil(end / part) if part else 0)):
                grads[r] += numel  # the parameter crosses into rank r's part
            start = end
    return padded_all, part_all, max(grads)


def model_states(f: ModelFacts, s: Setup) -> list[Row]:
    w, n_tensors = s.world_size, len(f.params)
    if s.parallelism.zero:
        kind = _PRECISION_KIND[s.precision]
        low = _BYTES[kind]
        sizes = _groups(f.params)
        steps = 4 * sum(1 for g in sizes if g)
        if s.zero_stage == 3:
            part = sum(math.ceil(p[0] / w) for p in f.params)
            params = 0 if s.offload_params else low * part
            grads, master = low * part, part
            how = f"{kind}, 1/{w} of each parameter (ZeRO-3)"
        else:
            padded, part, grad_elems = _zero12(sizes, w)
            if s.zero_stage == 1 and s.accumulation > 1:
                grad_elems = f.total  # ZeRO-1 accumulates every gradient whole between optimizer steps
            params, grads, master = low * padded, low * grad_elems, part
            how = f"{kind}, whole on every rank (ZeRO-{s.zero_stage})"
        opt = 0 if s.offload_optimizer else 12 * master + steps
        return [
            Row("parameters", params, how if not s.offload_params else "on the host (offload_params)"),
            Row("gradients", grads, f"{kind}, " + ("1/" + str(w) + " partition" if s.zero_stage == 3 else
                                                   "whole, accumulated over micro batches" if s.zero_stage == 1 and s.accumulation > 1
                                                   else "the parameters crossing into this rank's part")),
            Row("optimizer states", opt, "on the host (offload_optimizer)" if s.offload_optimizer else
                f"fp32 master weights + AdamW moments, 1/{w} each")]
    if s.parallelism.fsdp:
        local = sum(_fsdp_local(f, i, s) for i in range(len(f.params)))
        how = f"fp32, dim-0 shards, 1/{s.data_parallel} each (FSDP2)"
        if s.tensor_parallel > 1:
            how = (f"fp32, split over tensor_parallel({s.tensor_parallel}) by the TP plan, then dim-0 shards "
                   f"over data_parallel({s.data_parallel}) (FSDP2)")
        return [Row("parameters", 4 * local, how),
                Row("gradients", 4 * local, "fp32, sharded like the parameters"),
                Row("optimizer states", 8 * local + 4 * n_tensors, "AdamW moments fp32, sharded")]
    total = f.total
    if s.world_size == 1:  # one process runs without a data-parallel wrapper (lmtrain.distributed.strategies)
        return [Row("parameters", 4 * total, "fp32, one process (no data-parallel wrapper)"),
                Row("gradients", 4 * total, "fp32, the parameters' .grad"),
                Row("optimizer states", 8 * total + 4 * n_tensors, "AdamW moments fp32, whole")]
    return [Row("parameters", 4 * total, "fp32, whole on every rank (DDP)"),
            Row("gradients", 4 * total, "fp32, in DDP's buckets"),
            Row("optimizer states", 8 * total + 4 * n_tensors, "AdamW moments fp32, whole")]


def _fsdp_local(f: ModelFacts, i: int, s: Setup) -> int:
    """Elements of parameter ``i`` one rank holds: its tensor-parallel part (torch's Shard: the
    first rank's chunk is the largest), then FSDP2's dim-0 shard of that, padded to equal rows."""
    numel, rows = f.params[i][0], max(f.params[i][1], 1)
    cols, split = numel // rows, f.split_dim(i) if s.tensor_parallel > 1 else -1
    if split == 0:
        rows = math.ceil(rows / s.tensor_parallel)
    elif split == 1:
        cols = math.ceil(cols / s.tensor_parallel)
    return math.ceil(rows / s.data_parallel) * cols


def _trace(f: ModelFacts, compute: str, checkpointing: bool, micro_batch: int) -> tuple[int, int]:
    """(saved, head) bytes at ``micro_batch``: every saved tensor but a causal mask scales with it."""
    s1, h1, s2, h2 = f.traces[(compute, checkpointing)]
    b = micro_batch - 1
    return s1 + b * (s2 - s1), h1 + b * (h2 - h1)


def _logits_row(f: ModelFacts, s: Setup, head: int, tokens: int, low: int) -> Row:
    """Eager (the trace) keeps log-softmax's fp32 output; backward adds the gradient in fp32 and the
    compute dtype. A compiled loss keeps the logits and a log-sum-exp per token; one gradient."""
    if s.compiled and s.parallelism.compiles_loss:  # the trace's fp32 output becomes the logits and an lse
        return Row("logits and loss", head + tokens * f.vocab_size * (2 * low - 4) + 4 * tokens,
                   f"{f.vocab_size:,} logits per token and their gradient (compiled loss: no fp32 copy)")
    return Row("logits and loss", head + tokens * f.vocab_size * (4 + low),
               f"{f.vocab_size:,} logits per token, and their gradient in backward")


def _activations(f: ModelFacts, s: Setup) -> list[Row]:
    compute = compute_mode(s.parallelism, s.precision)
    saved, head = _trace(f, compute, s.checkpointing, s.micro_batch)
    tokens = s.micro_batch * f.seq_len
    low = 4 if compute == "fp32" else 2
    body, how = saved - head, f"saved for backward, {s.micro_batch} x {f.seq_len} tokens"
    if s.tensor_parallel > 1:  # an estimate: the trace is of the whole model
        body = math.ceil(body / s.tensor_parallel)
        how += (f", 1/{s.tensor_parallel} of the whole model's (estimated: heads and MLP features "
                + ("and the sequence " if s.sequence_parallel else "") + "split; gathered inputs held whole)")
    rows = [Row("activations", body, how + (", activation checkpointing" if s.checkpointing else "")),
            _logits_row(f, s, head, tokens, low)]
    if s.checkpointing and (compute, False) in f.traces:
        full, _ = _trace(f, compute, False, s.micro_batch)
        rows.append(Row("recomputed block", max(0, full - saved) // max(f.blocks, 1),
                        "one block's activations, rebuilt in backward"))
    return rows


def _buffers(f: ModelFacts, s: Setup) -> Row:
    largest = max((sum(p[0] for p in f.params if p[3] == b) for b in range(f.blocks)), default=0)
    if s.parallelism.zero:
        low = _BYTES[_PRECISION_KIND[s.precision]]
        if s.zero_stage == 3:
            persistent = sum(p[0] for p in f.params if p[0] <= ZERO3_PERSISTENCE)
            gathered = low * (2 * largest + persistent)
            return Row("communication buffers", gathered + low * s.reduce_bucket,
                       "gathered blocks (this and the prefetched one), small parameters kept whole, the reduction bucket")
        reduce = 4 if s.zero_stage == 1 else low
        buckets = 2 if s.overlap_comm else 1
        return Row("communication buffers", buckets * reduce * s.reduce_bucket,
                   f"{buckets} gradient reduction bucket(s) of {s.reduce_bucket:,} elements")
    if s.parallelism.fsdp:
        root = sum(p[0] for p in f.params if p[3] < 0)
        if s.tensor_parallel > 1:  # FSDP2 gathers over the data dimension only: TP parts
            whole = s.on(s.parallelism.with_world(s.tensor_parallel))  # data_parallel 1: a gathered TP part
            root = sum(_fsdp_local(f, i, whole) for i, p in enumerate(f.params) if p[3] < 0)
            largest = max((sum(_fsdp_local(f, i, whole) for i, p in enumerate(f.params) if p[3] == b)
                           for b in range(f.blocks)), default=0)
        gathered, which = (2 * largest, "this and the prefetched one") if s.data_parallel > 1 else (  # a one-rank
            f.blocks * largest, "every block: a one-rank shard group frees none")  # group: fsdp2.reshards_after_forward
        if s.precision == "bf16-mixed":  # lmtrain.model.fsdp2.shard_fsdp2: gathered in bf16, reduced in fp32
            return Row("communication buffers", 2 * (root + gathered) + (2 + 4) * largest,
                       f"gathered root and blocks in bf16 ({which}), a block's bf16 gradients "
                       "and their fp32 copy to reduce-scatter")
        return Row("communication buffers", 4 * (root + gathered + largest),
                   f"gathered root and blocks ({which}), a block's gradients to reduce-scatter")
    return Row("communication buffers", 0,
               "one process: nothing to reduce" if s.world_size == 1 else "DDP reduces in the gradient buckets")


def estimate(f: ModelFacts, s: Setup, capacity: int | None = None) -> Breakdown:
    rows = [*model_states(f, s), *_activations(f, s), _buffers(f, s)]
    if s.gpu:
        rows += [Row("cuBLAS workspaces", CUBLAS_WORKSPACES, "PyTorch's, one for forward's thread and one for backward's (32 MiB each on Hopper)"),
                 Row("framework", FRAMEWORK_BYTES - CUBLAS_WORKSPACES, "CUDA context and NCCL buffers (outside the caching allocator)")]
    return Breakdown(tuple(rows), capacity if s.gpu else None)


def gb(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GB:,.2f} GB" if n >= GB else f"{n / 1e6:,.2f} MB" if n >= 10e3 else f"{n:,} B"
