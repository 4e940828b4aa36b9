"""Periodic checkpoints written in the background while training goes on.

The training loop is blocked only while the checkpoint's state is copied into host memory
(:class:`Stager`: buffers reused from one save to the next, pinned when the state is on a GPU);
the write, the fsyncs and the COMPLETE marking run on a background thread
(:class:`BackgroundSave`), with the same protocol and the same atomicity as a synchronous save
(lmtrain.checkpoint.manager): a crash mid-write leaves a ``.step-S.tmp`` that is never resumed from, and
the previous complete checkpoint stays the newest. At most one save is in flight: the next save,
a stop and the end of training first wait for it.

Every strategy: for DDP rank 0 copies the whole state and its thread writes Lightning's file
alone; for DeepSpeed ZeRO and FSDP2 every rank copies its own shards (DTensors staged as their
local shard) and writes them in its own thread, in parallel (lmtrain.checkpoint.async_sharded). Every rank
writes its own small ``rank-R.pt`` before the background part starts.
"""

from __future__ import annotations

import copy as _copy
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmcore.run.checkpoint_index import LIGHTNING_NAME
from lmtrain import faults
from lmtrain.checkpoint.disk_space import DiskFull, no_room

log = logging.getLogger(__name__)


class Stager:
    """Copies of a checkpoint's tensors in host memory, reused between saves.

    Tensors that share storage (tied weights) are staged once and stay shared, so the file is
    no bigger than a synchronous save's. A buffer is reused when the tensor at the same place of
    the checkpoint has the same shape and dtype; it must not be staged into again before the
    previous save finished writing it (:class:`BackgroundSave` waits for that)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0  # host memory held by the buffers

    def stage(self, obj: Any) -> Any:
        shared: dict[tuple, torch.Tensor] = {}
        cuda = [False]
        staged = self._stage(obj, "", shared, cuda, copy=True)
        if cuda[0]:
            torch.cuda.synchronize()  # the non-blocking copies are done before the write reads them
        return staged

    def reserve(self, obj: Any) -> int:
        """The buffers a later ``stage(obj)`` of the same layout copies into, allocated now and
        their pages touched (pinned where the state is on a GPU), nothing copied: what a first
        save would otherwise spend holding training (page faults of fresh memory, or pinning).
        Only shapes, dtypes and storages are read, so a thread may do it while training changes
        the values. The bytes now held."""
        self._stage(obj, "", {}, [False], copy=False)
        return self.bytes

    def _stage(self, obj: Any, key: str, shared: dict[tuple, torch.Tensor], cuda: list[bool], *, copy: bool) -> Any:
        if _is_dtensor(obj):  # a shard of FSDP2's state: this rank's local part, same placement
            from torch.distributed.tensor import DTensor

            local = self._stage(obj._local_tensor, key, shared, cuda, copy=copy)
            return DTensor(local, obj._spec, requires_grad=False) if copy else None
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if ident in shared:
                return shared[ident]
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.is_cuda
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                if not copy and not pin:
                    buf.zero_()  # touched: its pages exist before a save needs them (pinned ones do)
                self._buffers[key] = buf
                self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
            if copy:
                buf.copy_(t, non_blocking=t.is_cuda)
                cuda[0] = cuda[0] or t.is_cuda
            shared[ident] = buf
            return buf
        if isinstance(obj, dict):
            out = {k: self._stage(v, f"{key}/{k}", shared, cuda, copy=copy) for k, v in obj.items()}
            if type(obj) is dict or not copy:
                return out
            same_kind = _copy.copy(obj)  # OrderedDict, defaultdict, AttributeDict: keep the class
            same_kind.clear()
            same_kind.update(out)
            return same_kind
        if isinstance(obj, list):
            return [self._stage(v, f"{key}/{i}", shared, cuda, copy=copy) for i, v in enumerate(obj)]
        if type(obj) is tuple:  # not torch.Size (DeepSpeed's param_shapes), nor a namedtuple: kept as they are
            return tuple(self._stage(v, f"{key}/{i}", shared, cuda, copy=copy) for i, v in enumerate(obj))
        return _copy.deepcopy(obj) if copy else None  # loop counters, hyperparameters, callback states: small


def _is_dtensor(obj: Any) -> bool:
    if type(obj) is torch.Tensor or not (isinstance(obj, torch.Tensor) and torch.distributed.is_available()):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


class BackgroundSave:
    """One background writer thread at a time; ``wait`` joins it and re-raises what it raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None  # the step being written

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int, write: Callable[[], None]) -> None:
        self.wait()
        self.step = step
        self._error = None

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # reported by wait(), on the training thread
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"lmtrain-checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> float:
        """Block until the save in flight (if any) is complete; the seconds waited."""
        thread = self._thread
        if thread is None:
            return 0.0
        t0 = time.perf_counter()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the background save of step {self.step} did not finish within {timeout} s")
        self._thread = None
        waited = time.perf_counter() - t0
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, DiskFull):
                raise error  # already says which checkpoint and why
            raise RuntimeError(f"the background save of checkpoint step-{self.step} failed: "
                               f"{type(error).__name__}: {error}") from error
        return waited


def reserve_in_background(manager: Any, trainer: Any, step: int,
                          take: Callable[[Any, Any], list[tuple[Stager, Any]]]) -> None:
    """Collective: ``take`` gets the state as a save takes it (shapes only: every rank, as a save
    runs its hooks), then a background thread allocates and touches the host buffers its staging
    copies into (Stager.reserve), so that even a first save (a stop before any periodic save)
    holds training only for the copy. A save waits for that thread (``manager.background``); a
    failure to reserve (no memory) is logged and leaves the buffers to the first save, as before."""
    t0 = time.perf_counter()
    parts = take(manager, trainer)
    held = time.perf_counter() - t0
    if not parts:
        return

    def run() -> None:
        try:
            t1 = time.perf_counter()
            for stager, state in parts:
                stager.reserve(state)
            parts.clear()  # the references to the live state
            stagers = {id(s): s for s in [manager.stager, *manager.stagers.values()]}
            reserved = sum(s.bytes for s in stagers.values())
            log.info("staging buffers reserved: %d bytes (%.2f GB) of host memory in %.2fs (training held %.3fs)",
                     reserved, reserved / 1e9, time.perf_counter() - t1, held)
        except Exception as exc:  # MemoryError, a pinning failure: the first save allocates, as before
            parts.clear()
            log.warning("could not reserve the checkpoint staging buffers (%s: %s): the first save allocates them",
                        type(exc).__name__, exc)

    manager.background.start(step, run)


def reserve_ddp(manager: Any, trainer: Any) -> list[tuple[Stager, Any]]:
    """Every rank (as a save): Lightning's state; rank 0, which alone stages it, reserves for it."""
    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return [(manager.stager, state)] if trainer.global_rank == 0 else []


def save_ddp_in_background(manager: Any, trainer: Any, *, step: int, rank_state: dict[str, Any],
                           on_complete: Callable[[Path, float, float], None] | None) -> tuple[Path, float]:
    """DDP, every rank (lmtrain.checkpoint.manager.CheckpointManager.save): the Lightning state is taken
    (its hooks run on every rank, as in ``trainer.save_checkpoint``) and its own rank file
    written; rank 0 copies the state into host memory, and its thread writes Lightning's file
    and completes the checkpoint. (its path, seconds the caller was blocked)"""
    t0 = time.perf_counter()
    tmp, final = manager._begin(trainer, step)
    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    staged = manager.stager.stage(state) if trainer.global_rank == 0 else None
    del state
    faults.point("checkpoint.staged", file=LIGHTNING_NAME, rank=trainer.global_rank)
    manager._settle(trainer, no_room(lambda: manager._rank_part(trainer, tmp, step, rank_state), manager.dir,
                                     manager.needed_bytes), tmp, final, step)
    blocked = time.perf_counter() - t0
    if trainer.global_rank != 0:
        return final, blocked
    world, io = trainer.world_size, trainer.strategy.checkpoint_io

    def write() -> None:
        io.save_checkpoint(staged, tmp / LIGHTNING_NAME)
        faults.point("checkpoint.rank_saved", file=LIGHTNING_NAME, rank=0, step=step)

    def run() -> None:
        faults.set_context(step=step)  # this thread's points are about this step
        manager._finish_or_remove(tmp, final, step, world, write)
        if on_complete is not None:
            on_complete(final, manager.completed_at - t0, blocked)

    manager.background.start(step, run)
    return final, blocked
