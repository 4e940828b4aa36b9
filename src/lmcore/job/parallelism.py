"""How the model is split over the ranks: the one typed owner of the parallelism concept.

A :class:`Parallelism` is the device mesh of one run (data-parallel ranks, tensor-parallel ranks
inside a node, pipeline stages) and what implements each dimension: the data dimension is
replicated (DDP), sharded (FSDP2) or partitioned by DeepSpeed ZeRO at a stage. The planner makes
it once from the spec (:meth:`Parallelism.of_trainer`), the plan carries it (``plan.parallelism``),
and everything that used to compare strategy names asks it instead: the memory rows, the
checkpoint format and whether a checkpoint can be resharded, the module's setup, the sampler's
data-parallel rank count, the NCCL notes, export, status and history.

This module is the only one that maps the spec's strategy words to the concept
(:class:`DataParallel` values are the spec's ``trainer.strategy`` words, and the checkpoints'
``meta.json`` keeps writing them, so that older checkpoints and plans read the same). Adding a
way to split the model means adding it here and the one runtime module that builds it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any


class DataParallel(enum.Enum):
    """What implements the data dimension (values: the spec's ``trainer.strategy`` words)."""

    REPLICATE = "ddp"  # each rank holds the whole replica; DDP all-reduces gradients in buckets
    SHARD = "fsdp"  # FSDP2: dim-0 shards of every parameter, gathered per block
    ZERO = "deepspeed"  # DeepSpeed's engine, ZeRO stage 1-3


class CheckpointFormat(enum.Enum):
    """How a run's checkpoint is laid out on disk, by what wrote it."""

    FULL = "full"  # rank 0 writes whole tensors (torch.save): any layout reads it
    DCP = "dcp"  # torch.distributed.checkpoint shards: resharded on load to any mesh
    ZERO = "zero"  # DeepSpeed's per-rank ZeRO files: another world size goes through the universal checkpoint


_WHAT_RESHARDS = {
    CheckpointFormat.FULL: "the DDP checkpoint holds full tensors",
    CheckpointFormat.DCP: "torch.distributed.checkpoint reshards the FSDP, tensor-parallel and pipeline-stage shards",
    CheckpointFormat.ZERO: "rank 0 converts the ZeRO checkpoint to DeepSpeed's universal checkpoint when the job starts",
}


def trainer_problem(strategy: str, zero_stage: int | None, tensor: int, sequence_parallel: bool,
                    offload_optimizer: bool, offload_params: bool, pipeline: int = 1,
                    split: list[int] | None = None, microbatches: int | None = None) -> str | None:
    """What is wrong with the spec's ``trainer`` parallelism keys taken together (None: nothing);
    the spec's validator raises it (one message naming the keys)."""
    data = DataParallel(strategy)
    if zero_stage is not None and data is not DataParallel.ZERO:
        return f"trainer.zero_stage({zero_stage}) needs trainer.strategy: deepspeed (strategy is '{strategy}')"
    if data is DataParallel.ZERO and zero_stage is None:
        return "trainer.strategy deepspeed needs trainer.zero_stage (1, 2 or 3)"
    if offload_optimizer and (zero_stage or 0) < 2:
        return f"trainer.offload_optimizer needs DeepSpeed zero_stage >= 2 (zero_stage is {zero_stage})"
    if tensor > 1 and data is not DataParallel.SHARD:
        return (f"trainer.tensor_parallel_size({tensor}) needs trainer.strategy: fsdp (FSDP2 over the "
                f"data-parallel ranks, TP inside each node); strategy is '{strategy}'")
    if sequence_parallel and tensor < 2:
        return ("trainer.sequence_parallel splits the sequence over the tensor-parallel ranks: it needs "
                f"trainer.tensor_parallel_size >= 2 (it is {tensor})")
    if offload_params and zero_stage != 3:
        return f"trainer.offload_params needs DeepSpeed zero_stage 3 (zero_stage is {zero_stage})"
    if pipeline > 1 and data is not DataParallel.SHARD:
        return (f"trainer.pipeline_parallel_size({pipeline}) needs trainer.strategy: fsdp (FSDP2 over the "
                f"data-parallel ranks of each stage, as torchtitan runs it; DDP and DeepSpeed's engine cannot "
                f"drive a pipeline schedule); strategy is '{strategy}'")
    if pipeline > 1 and sequence_parallel:
        return (f"trainer.sequence_parallel with trainer.pipeline_parallel_size({pipeline}): the stages pass whole "
                "activations between them; use sequence_parallel: false (tensor parallelism itself works with pipelines)")
    if pipeline == 1 and (split is not None or microbatches is not None):
        key = "trainer.pipeline_split" if split is not None else "trainer.pipeline_microbatches"
        return f"{key} needs trainer.pipeline_parallel_size > 1 (it is 1)"
    return None


@dataclass(frozen=True)
class Parallelism:
    """The mesh ``world_size = data_parallel x tensor x pipeline`` and what implements each
    dimension. Immutable; :meth:`to_json`/:meth:`from_json` carry it in ``plan.json``."""

    data: DataParallel
    world_size: int
    zero_stage: int | None = None  # ZERO only: 1, 2 or 3
    tensor: int = 1  # tensor-parallel ranks of one model replica, inside a node (FSDP2 x TP)
    sequence_parallel: bool = False  # the residual stream split along the sequence between TP matmuls
    pipeline: int = 1  # pipeline ranks of one model replica
    schedule: str = "1f1b"  # the pipeline's schedule (lmcore.job.pipeline_stages.SCHEDULES)
    microbatches: int = 1  # per step and replica, when pipeline > 1
    split: tuple[int, ...] | None = None  # layers per stage as the spec gave them (None: balanced)

    # -- made from names: the spec, a plan's older fields, a checkpoint's meta.json ----------

    @classmethod
    def of(cls, strategy: str, world_size: int, *, zero_stage: int | None = None, tensor: int = 1,
           sequence_parallel: bool = False, pipeline: int = 1, schedule: str = "1f1b", microbatches: int = 1,
           split: Sequence[int] | None = None) -> Parallelism:
        data = DataParallel(strategy)
        return cls(data=data, world_size=max(1, int(world_size)),
                   zero_stage=int(zero_stage) if data is DataParallel.ZERO and zero_stage else None,
                   tensor=max(1, int(tensor)), sequence_parallel=bool(sequence_parallel), pipeline=max(1, int(pipeline)),
                   schedule=str(schedule), microbatches=max(1, int(microbatches)),
                   split=tuple(int(k) for k in split) if split is not None else None)

    @classmethod
    def of_trainer(cls, trainer: Any, world_size: int, *, tensor: int | None = None, pipeline: int | None = None,
                   microbatches: int = 1) -> Parallelism:
        """From the spec's ``trainer`` section (``tensor``, ``pipeline``: the sizes the planner
        accepted; ``microbatches``: what it derived)."""
        return cls.of(trainer.strategy, world_size, zero_stage=trainer.zero_stage,
                      tensor=trainer.tensor_parallel_size if tensor is None else tensor,
                      sequence_parallel=trainer.sequence_parallel,
                      pipeline=trainer.pipeline_parallel_size if pipeline is None else pipeline,
                      schedule=trainer.pipeline_schedule, microbatches=microbatches, split=trainer.pipeline_split)

    @classmethod
    def of_meta(cls, meta: dict[str, Any]) -> Parallelism:
        """The layout a checkpoint was written in (its ``meta.json``: strategy, world_size,
        tensor_parallel_size; older checkpoints lack the last: 1). Raises KeyError/ValueError on
        a meta.json without them."""
        return cls.of(str(meta["strategy"]), int(meta["world_size"]), zero_stage=meta.get("zero_stage"),
                      tensor=int(meta.get("tensor_parallel_size") or 1),
                      pipeline=int(meta.get("pipeline_parallel_size") or 1))

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.data.value, "world_size": self.world_size, "zero_stage": self.zero_stage,
                "tensor": self.tensor, "sequence_parallel": self.sequence_parallel, "pipeline": self.pipeline,
                "schedule": self.schedule, "microbatches": self.microbatches,
                "split": list(self.split) if self.split is not None else None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Parallelism:
        return cls.of(d["strategy"], d["world_size"], zero_stage=d.get("zero_stage"), tensor=d.get("tensor", 1),
                      sequence_parallel=d.get("sequence_parallel", False), pipeline=d.get("pipeline", 1),
                      schedule=d.get("schedule", "1f1b"), microbatches=d.get("microbatches", 1), split=d.get("split"))

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's meta.json records of the layout it was written in."""
        return {"strategy": self.data.value, "world_size": self.world_size, "tensor_parallel_size": self.tensor,
                "pipeline_parallel_size": self.pipeline}

    # -- what the rest of lmlaunch asks -------------------------------------------------------

    @property
    def strategy(self) -> str:
        """The spec's word for the data dimension (messages, meta.json, ``trainer.strategy``)."""
        return self.data.value

    @property
    def replicated(self) -> bool:
        """DDP: every rank holds the whole model and its optimizer state."""
        return self.data is DataParallel.REPLICATE

    @property
    def fsdp(self) -> bool:
        """FSDP2 (with tensor parallelism inside nodes when ``tensor`` > 1): Lightning's ModelParallelStrategy."""
        return self.data is DataParallel.SHARD

    @property
    def zero(self) -> bool:
        """DeepSpeed ZeRO: the engine casts the model, accumulates and clips itself."""
        return self.data is DataParallel.ZERO

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: ranks that read different samples (tensor and pipeline ranks read the same)."""
        return max(1, self.world_size // (self.tensor * self.pipeline))

    @property
    def shards_stages(self) -> bool:
        """Whether FSDP2 shards a pipeline's stages: with several replicas, and under tensor
        parallelism (whose embedding gradient FSDP2's reduce-scatter keeps to the rank's rows). One
        plain replica has nothing to shard, and the zero-bubble schedules' split weight backward
        needs it so (lmcore.job.pipeline_stages refuses them otherwise)."""
        return self.data_parallel_size > 1 or self.tensor > 1

    @property
    def compiles_loss(self) -> bool:
        """Whether ``model.compile`` compiles the loss beside the blocks (lmtrain.model.causal_lm):
        where one rank holds whole logits and computes the loss itself (no tensor split of them,
        no pipeline stage that computes it). The memory plan's logits row follows."""
        return self.tensor == 1 and self.pipeline == 1

    def loader_batch(self, micro_batch: int) -> int:
        """Samples a rank's loader gives per training step: a micro batch, or a pipeline's
        microbatches together (its schedule splits them)."""
        return micro_batch * (self.microbatches if self.pipeline > 1 else 1)

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global rank ``rank`` (the mesh is (data, pipeline, tensor),
        tensor innermost: a replica's ranks are consecutive and read the same samples)."""
        return rank // (self.tensor * self.pipeline)

    def peer_groups(self) -> list[list[int]]:
        """Ranks that do the same work each step, to compare with each other (the straggler
        scorer): all of them, or a pipeline's ranks by stage (stages differ by design)."""
        if self.pipeline == 1:
            return [list(range(self.world_size))]
        return [[r for r in range(self.world_size) if (r // self.tensor) % self.pipeline == p] for p in range(self.pipeline)]

    @property
    def checkpoint(self) -> CheckpointFormat:
        return {DataParallel.REPLICATE: CheckpointFormat.FULL, DataParallel.SHARD: CheckpointFormat.DCP,
                DataParallel.ZERO: CheckpointFormat.ZERO}[self.data]

    @property
    def sharded_checkpoint(self) -> bool:
        """Every rank writes its own part (DCP, ZeRO files); else rank 0 writes the whole."""
        return self.checkpoint is not CheckpointFormat.FULL

    def checkpoint_bytes_per_param(self, precision: str) -> int:
        """A checkpoint with AdamW: fp32 weights + two fp32 moments; DeepSpeed under mixed
        precision also keeps the low-precision module weights beside the fp32 master copy."""
        return 14 if self.zero and not precision.startswith("32") else 12

    def compute_mode(self, kind: str) -> str:
        """How the forward computes at precision kind ``kind`` (fp32, bf16, fp16): Lightning's
        mixed precision runs the fp32 model under autocast; DeepSpeed casts the model itself."""
        if kind == "fp32":
            return "fp32"
        return kind if self.zero else f"autocast-{kind}"

    def same_format(self, other: Parallelism) -> bool:
        """Whether a checkpoint written at ``other`` is in this run's format (else it cannot be resumed)."""
        return self.checkpoint is other.checkpoint

    def same_layout(self, other: Parallelism) -> bool:
        return (self.world_size, self.tensor, self.pipeline) == (other.world_size, other.tensor, other.pipeline)

    def reshard_how(self) -> str:
        """How a checkpoint of this format written on another layout is loaded on this one."""
        return _WHAT_RESHARDS[self.checkpoint]

    def with_data(self, data: DataParallel, zero_stage: int | None = None) -> Parallelism:
        """The same mesh with another data-parallel implementation (the memory plan's suggestions)."""
        return replace(self, data=data, zero_stage=zero_stage if data is DataParallel.ZERO else None)

    def with_world(self, world_size: int) -> Parallelism:
        return replace(self, world_size=world_size)

    # -- said to users ------------------------------------------------------------------------

    def describe(self) -> str:
        """``ddp``, ``deepspeed ZeRO-2``, ``fsdp x tensor_parallel(2)``: status, history, export."""
        base = f"deepspeed ZeRO-{self.zero_stage}" if self.zero and self.zero_stage else self.data.value
        parts = [base] + ([f"tensor_parallel({self.tensor})"] if self.tensor > 1 else []) + (
            [f"pipeline_parallel({self.pipeline})"] if self.pipeline > 1 else [])
        return " x ".join(parts)

    def mesh(self) -> str:
        """``data_parallel(2) x tensor_parallel(2)`` (the dimensions above 1 beside the data one)."""
        dims = [f"data_parallel({self.data_parallel_size})"]
        dims += [f"tensor_parallel({self.tensor})"] if self.tensor > 1 else []
        dims += [f"pipeline_parallel({self.pipeline})"] if self.pipeline > 1 else []
        return " x ".join(dims)
