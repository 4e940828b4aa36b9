"""What one rank really holds for the model: parameters, gradients and optimizer states, counted
from the running engine's own tensors (DDP and FSDP2 through torch, DeepSpeed ZeRO 1/2/3 through
its optimizer's partitions), and the device's own peak where it reports one.

Counted entering the second optimizer step (:class:`MemoryRecord`): backward is done, the
gradients are in their reduced (and, where the strategy shards them, partitioned) form, and
AdamW's states exist (torch creates them lazily in the first step; DeepSpeed when the engine
starts). Every tensor is counted once, by its storage: a gradient that is a view of a DDP bucket
is the bucket; ZeRO's parameters are views of its flat buffers, whose padding is held memory too.
Tensors the engine holds besides these (DeepSpeed's reduction buckets, FSDP2's unsharded views)
are ``buffers``. The ledger's ``memory`` line carries each rank's figures, so that the plan's
estimate (launcher.planning.memory) can be read against them (``lmlaunch history``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

log = logging.getLogger(__name__)

MEASURED_AT_STEP = 2  # entering this optimizer step (counted from the attempt's first)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    st = t.untyped_storage()
    return str(t.device), st.data_ptr() if st.data_ptr() else id(st)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class _Tally:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            if t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key in self.seen:
                continue
            self.seen.add(key)
            self.bytes[category] += t.untyped_storage().nbytes()


def _tensors_in(obj: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors in nested lists, tuples and dicts (an optimizer's state, DeepSpeed's groups)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)


# DeepSpeed ZeRO optimizers' attributes, by what they hold (deepspeed 0.19: stage_1_and_2.py and
# stage3.py). Master weights are optimizer state (ZeRO's own accounting: 4 + 8 bytes per parameter).
_DS_PARAMS = ("bit16_groups_flat", "fp16_partitioned_groups_flat")
_DS_OPTIMIZER = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_DS_GRADS = ("averaged_gradients", "all_grad_tensors", "grad_partitions_flat_buffer",
             "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")


def held_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds per category (params, grads, optimizer, buffers), each storage once."""
    tally = _Tally()
    zero = getattr(optimizer, "optimizer", None) is not None and any(hasattr(optimizer, a) for a in _DS_PARAMS + _DS_OPTIMIZER)
    inner = optimizer.optimizer if zero else optimizer
    if zero:
        for attr in _DS_PARAMS:
            tally.add("params", _tensors_in(getattr(optimizer, attr, None)))
        tally.add("params", (getattr(p, "ds_tensor", None) for p in model.parameters()))
    # ZeRO-3's full parameters exist only while gathered (for a forward or backward, or kept
    # gathered below its persistence threshold): working buffers, not the rank's parameters.
    tally.add("buffers" if hasattr(optimizer, "fp16_partitioned_groups_flat") else "params",
              (p for p in model.parameters() if p.numel()))
    if zero:
        for attr in _DS_OPTIMIZER:
            tally.add("optimizer", _tensors_in(getattr(optimizer, attr, None)))
    tally.add("optimizer", _tensors_in(getattr(inner, "state", {}), depth=3))
    if zero:
        for attr in _DS_GRADS:
            tally.add("grads", _tensors_in(getattr(optimizer, attr, None)))
        for attr in _DS_OPTIMIZER:  # ZeRO 1/2 hand the fp32 partitions their gradient at the step
            tally.add("grads", (getattr(t, "grad", None) for t in _tensors_in(getattr(optimizer, attr, None))))
    tally.add("grads", (p.grad for p in model.parameters() if p.grad is not None))
    tally.add("grads", (getattr(p, "grad_accum", None) for p in model.parameters()))  # ZeRO-1/2's fp32 accumulators
    if zero:
        for bucket in getattr(optimizer, "ipg_buckets", {}).values():  # gradient reduction buckets, per dtype
            tally.add("buffers", _tensors_in(getattr(bucket, "buffer", None)))
        for name, value in vars(optimizer).items():  # and the rest the engine holds
            if name != "optimizer":
                tally.add("buffers", _tensors_in(value, depth=2))
    return tally.bytes


def device_peak_bytes(device: torch.device) -> int | None:
    """The device's own peak (CUDA's max allocated) since it was last reset; None where none is kept (CPU)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    return None


class MemoryRecord(pl.Callback):
    """Entering the second optimizer step of the attempt, every rank counts what it holds
    (:func:`held_bytes`); rank 0 writes the ranks' figures into the ledger (``memory``, ``held``:
    one mapping per rank). When training ends on a device that keeps a peak (CUDA), a second
    ``memory`` line gives each rank's (``device_peak``)."""

    def __init__(self, write: Any, *, start_step: int) -> None:
        self.write, self.start_step = write, start_step
        self.done = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.done or trainer.global_step < self.start_step + MEASURED_AT_STEP - 1:
            return
        self.done = True
        engine = getattr(trainer.strategy, "model", None)
        zero_optimizer = getattr(engine, "optimizer", None) if hasattr(engine, "zero_optimization_stage") else None
        try:
            mine = held_bytes(pl_module, zero_optimizer if zero_optimizer is not None else optimizer)
            ranks = _gather(mine, trainer.world_size)
        except Exception as exc:  # a measurement never costs the run
            log.warning("could not count the memory this rank holds: %s", exc)
            return
        if trainer.global_rank == 0:
            self.write({"step": trainer.global_step + 1, "held": ranks})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        peak = device_peak_bytes(pl_module.device)
        if peak is None:  # the same device type on every rank: all or none take part
            return
        try:
            peaks = _gather({"device_peak": peak}, trainer.world_size)
        except Exception as exc:
            log.warning("could not gather the ranks' peak device memory: %s", exc)
            return
        if trainer.global_rank == 0:
            self.write({"step": trainer.global_step, "device_peak": [p["device_peak"] for p in peaks]})


def _gather(mine: dict[str, Any], world: int) -> list[dict[str, Any]]:
    if world == 1 or not torch.distributed.is_initialized():
        return [mine]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, mine)
    return out
