"""Periodic checkpoints of the sharded strategies (DeepSpeed ZeRO 1/2/3, FSDP2) written in the
background: every rank writes its own files in its own thread, in parallel.

The protocol of a synchronous save (lmtrain.checkpoint.manager) with the writes moved off the training
thread, and the same guarantees:

1. training is blocked only while each rank copies ITS OWN part of the state into host memory
   (lmtrain.checkpoint.async_checkpoint.Stager, buffers reused from save to save; no gather to rank 0) and
   writes its small ``rank-R.pt`` (synchronously, as always);
2. each rank's writer thread writes its files into ``.step-S.tmp/lightning.ckpt/`` (the layout of
   the synchronous save: resume reads it unchanged) and fsyncs them;
3. the writer threads tell each other how it went over a gloo group of their own
   (:class:`WriterGroup`, made once by every rank when training starts): a collective on the
   training process group from a second thread would race the training loop's own. Only when
   every rank's files are written and fsynced does rank 0 complete the checkpoint (meta.json,
   rename to ``step-S``, COMPLETE, ``latest``, pruning). A failure anywhere: rank 0 removes the
   partial save and every rank's thread raises the same error (:class:`DiskFull` when a write
   found no room), which ``CheckpointManager.finish_background`` agrees on.

DeepSpeed writes each file of its checkpoint through ``engine.checkpoint_engine.save(state,
path)`` (TorchCheckpointEngine: ``torch.save``). During the staging :class:`ZeroStaging` stands
in for it around Lightning's ``trainer.save_checkpoint`` (so DeepSpeed's own collectives and
barriers run on the training thread, as in a synchronous save): it copies each state into host
memory instead of writing it, and the writer thread ``torch.save``s the copies as DeepSpeed would
have (streamed to disk: lmtrain.checkpoint.shard_files). The files DeepSpeed writes itself (rank
0's ``latest``, ``zero_to_fp32.py``) are written during the staging; rank 0 fsyncs them with the
rest before COMPLETE. Under ZeRO-3 the staging skips DeepSpeed's partition/re-gather round trip of
the persistent parameters and writes the same files (:func:`_gathered_parameters_saved_as_partitions`). Another checkpoint engine
(DeepSpeed's fast, decoupled or DataStates writers) keeps its synchronous saves.

FSDP2: the synchronous save of lmtrain.checkpoint.shard_files with only its DCP write moved: the same
conversion (``state_dict`` and ``optimizer_<i>`` go to DCP, every rank its ``__R_0.distcp``,
rank 0 ``.metadata``; the rest is ``torch.save``d by rank 0 as ``meta.pt``), the DTensor shards
staged, and ``dcp.save`` over the writer group in the thread, so that
``ModelParallelStrategy.load_checkpoint`` resumes it.

The writer threads pass the fault points of a synchronous save (``checkpoint.wrote``,
``checkpoint.fsync``, ``checkpoint.rank_saved`` and rank 0's completion: lmtrain.faults).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lmcore.run.checkpoint_index import LIGHTNING_NAME
from lmtrain import faults
from lmtrain.checkpoint import checksums
from lmtrain.checkpoint.async_checkpoint import Stager
from lmtrain.checkpoint.completion import RESERVE_DIR_NAME
from lmtrain.checkpoint.disk_space import DiskFull, free_bytes, means_no_room, no_room, remove_partial
from lmtrain.checkpoint.durable import fsync_file
from lmtrain.checkpoint.shard_files import (
    META_NAME,
    dcp_save as _dcp_save,
    fsdp_parts,
    save_file,
    stream_deepspeed_files,
)

log = logging.getLogger("lmtrain.checkpoint.manager")

class WriterGroup:
    """The collectives of the checkpoint writer threads: a gloo group over every rank of its own
    (None on one rank, where there is nobody to tell)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out


def start_writers(manager: Any, trainer: Any) -> None:
    """Collective, every rank when training starts (background saves on): the writer group of a
    sharded strategy's background saves (``manager.writers``); without it saves stay synchronous."""
    if not manager.parallelism.sharded_checkpoint or manager.writers is not None:
        return
    if manager.parallelism.zero and not stream_deepspeed_files(trainer.strategy.deepspeed_engine):
        log.warning("DeepSpeed writes checkpoints through %s, not torch.save: periodic saves stay synchronous",
                    type(trainer.strategy.deepspeed_engine.checkpoint_engine).__name__)
        return
    dist = torch.distributed
    group = None
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=manager.collective_timeout)  # collective: every rank
    manager.writers = WriterGroup(group, trainer.global_rank, trainer.world_size if group is not None else 1)


def save_in_background(manager: Any, trainer: Any, *, step: int, rank_state: dict[str, Any],
                       on_complete: Callable[[Path, float, float], None] | None) -> tuple[Path, float]:
    """Collective: stage this rank's part and write its rank file (training waits for that), then
    write the shards in this rank's thread; rank 0's completes the checkpoint. (its path, seconds
    the caller was blocked)."""
    t0 = time.perf_counter()
    tmp, final = manager._begin(trainer, step)
    rank, world = trainer.global_rank, trainer.world_size
    stage = _stage_zero if manager.parallelism.zero else _stage_dcp
    writes: list[Callable[[], None]] = []

    def parts() -> None:
        writes.append(stage(manager, trainer, tmp / LIGHTNING_NAME))
        faults.point("checkpoint.staged", file=LIGHTNING_NAME, rank=rank)
        manager._rank_part(trainer, tmp, step, rank_state)

    manager._settle(trainer, no_room(parts, manager.dir, manager.needed_bytes), tmp, final, step)
    blocked = time.perf_counter() - t0
    write, writers = writes[0], manager.writers

    def run() -> None:
        faults.set_context(step=step)  # this thread's points are about this step
        said = writers.all_gather(_write_own(manager, write, rank, step, tmp, final))
        failed = [s for s in said if s is not None]
        if failed:
            if rank == 0:
                remove_partial(tmp, final)
            how = "; ".join(f"rank {s['rank']}: {s['error']}" for s in failed)
            if any(s["no_room"] for s in failed):
                raise DiskFull(manager.dir, step, manager.needed_bytes(), free_bytes(manager.dir),
                               f"a background write found no room: {how}")
            raise RuntimeError(f"a rank's background write failed: {how}")
        if rank == 0:  # every rank's files are written and fsynced
            manager._finish_or_remove(tmp, final, step, world)
            if on_complete is not None:
                on_complete(final, manager.completed_at - t0, blocked)

    manager.background.start(step, run)
    return final, blocked


def _write_own(manager: Any, write: Callable[[], None], rank: int, step: int, tmp: Path,
               final: Path) -> dict[str, Any] | None:
    """Write this rank's files; None, or what went wrong (for every rank to hear)."""
    try:
        write()
        faults.point("checkpoint.rank_saved", file=LIGHTNING_NAME, rank=rank, step=step)
        checksums.write_sidecar(tmp, rank)  # its shards' checksums too, for rank 0's manifest
        if manager.publisher is not None:  # checkpoint.dir s3://: its files to the bucket, now
            manager.publisher.publish(tmp, final)
    except Exception as exc:
        log.error("checkpoint step-%d: rank %d's background write failed: %s", step, rank, exc)
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                "no_room": means_no_room(exc, manager.dir, manager.needed_bytes)}
    return None


# --- DeepSpeed ------------------------------------------------------------------------------
class ZeroStaging:
    """DeepSpeed's checkpoint engine during a background save's staging: ``save`` copies the
    state into host memory (one Stager per file, so its buffers are reused at the next save)
    and records it; everything else is the engine's own (``__getattr__``)."""

    def __init__(self, engine: Any, root: Path, stagers: dict[str, Stager], *, reserving: bool = False) -> None:
        self.engine, self.root, self.stagers = engine, root, stagers
        self.reserving = reserving  # record each file's state for Stager.reserve, copy nothing
        self.files: list[tuple[Path, Any]] = []
        # module-state entries saved as DeepSpeed's partitioned placeholders (ZeRO-3, see below)
        self.placeholders: dict[str, torch.dtype] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def create(self, info: Any) -> None:
        return None

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        module = state_dict.get("module") if isinstance(state_dict, dict) and self.placeholders else None
        if isinstance(module, dict):
            state_dict = {**state_dict, "module": type(module)(
                (k, torch.empty(0, dtype=self.placeholders[k]) if k in self.placeholders else v) for k, v in module.items())}
        stager = self.stagers.setdefault(Path(path).relative_to(self.root).as_posix(), Stager())
        self.files.append((Path(path), state_dict if self.reserving else stager.stage(state_dict)))

    def commit(self, info: Any) -> bool:
        return True

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed then hands over its state as it is instead of cloning every tensor first
        # (torch.save of a view would write its whole storage); the staged copies are compact already
        return False


def _stage_zero(manager: Any, trainer: Any, root: Path) -> Callable[[], None]:
    engine = trainer.strategy.deepspeed_engine
    original = engine.checkpoint_engine
    staging = ZeroStaging(original, root, manager.stagers)
    engine.checkpoint_engine = staging
    try:
        with _gathered_parameters_saved_as_partitions(engine, staging):
            trainer.save_checkpoint(str(root))  # collective: DeepSpeed's barriers, its `latest` (rank 0)
    finally:
        engine.checkpoint_engine = original
    zipfile = bool(getattr(original, "zipfile_serialization", True))  # TorchCheckpointEngine's torch.save
    rank = trainer.global_rank

    def write() -> None:
        for path, staged in staging.files:
            save_file(staged, path, rank, _use_new_zipfile_serialization=zipfile)

    return write


@contextlib.contextmanager
def _gathered_parameters_saved_as_partitions(engine: Any, staging: ZeroStaging) -> Iterator[None]:
    """ZeRO-3's save without its partition/re-gather round trip, same files.

    DeepSpeed's save first partitions every gathered parameter (``checkpoint_event_prologue``: the
    persistent ones, under ``stage3_param_persistence_threshold``, stay gathered between steps) so
    that the module state it saves holds each parameter as its empty partitioned placeholder, then
    all-gathers the persistent ones again (``checkpoint_event_epilogue``: one collective per
    parameter on gloo, 0.05 s of a 0.17 s staging for GPT-2 124M). The weights themselves are
    saved from the optimizer's partitions, which the round trip does not touch. Here the two events
    are skipped and the staged module state gets the same placeholders (``torch.empty(0, dtype)``,
    what DeepSpeed's ``free_param`` leaves) for the parameters that are gathered: the files are
    the ones DeepSpeed writes, and the gathered parameters stay as they were."""
    optimizer: Any = getattr(engine, "optimizer", None)
    stage3 = getattr(engine, "zero_optimization_partition_weights", lambda: False)()  # ZeRO-3 partitions weights
    if not (stage3 and hasattr(optimizer, "checkpoint_event_prologue")):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    staging.placeholders = {name: p.dtype for name, p in engine.module.named_parameters(remove_duplicate=False)
                            if getattr(p, "ds_status", None) not in (None, ZeroParamStatus.NOT_AVAILABLE)}
    optimizer.checkpoint_event_prologue = optimizer.checkpoint_event_epilogue = _nothing
    try:
        yield
    finally:
        del optimizer.checkpoint_event_prologue, optimizer.checkpoint_event_epilogue  # the class's own again


def _nothing(*_: Any) -> None:
    return None


def reserve_zero(manager: Any, trainer: Any) -> list[tuple[Stager, Any]]:
    """Collective: DeepSpeed's save run with :class:`ZeroStaging` recording each file's state
    instead of copying it (DeepSpeed builds those states inside its save, so this is the one way
    to learn their shapes), into a scratch directory that rank 0 removes after every rank left it.
    (the stager of each file, its state) for Stager.reserve."""
    engine = trainer.strategy.deepspeed_engine
    original = engine.checkpoint_engine
    scratch = manager.dir / RESERVE_DIR_NAME
    if trainer.global_rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    trainer.strategy.barrier("lmtrain.checkpoint.reserve.begin")
    root = scratch / LIGHTNING_NAME
    staging = ZeroStaging(original, root, manager.stagers, reserving=True)
    engine.checkpoint_engine = staging
    # no tag check: it compares the tag's hash over the ranks, reading it back on the host (a device
    # sync at a training step, tests/unit/test_host_reads.py), for a save that writes nothing
    engine._checkpoint_tag_validation = _nothing
    try:
        with _gathered_parameters_saved_as_partitions(engine, staging):
            trainer.save_checkpoint(str(root))  # collective; writes only DeepSpeed's own small files
    finally:
        engine.checkpoint_engine = original
        del engine._checkpoint_tag_validation  # the class's own again
    trainer.strategy.barrier("lmtrain.checkpoint.reserve.end")
    if trainer.global_rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    return [(manager.stagers[path.relative_to(root).as_posix()], state) for path, state in staging.files]


def reserve_dcp(manager: Any, trainer: Any) -> list[tuple[Stager, Any]]:
    """Collective: FSDP2's state as its staging takes it (this rank's shards; rank 0 the rest)."""
    converted, state = fsdp_parts(trainer)
    out = [(manager.stagers.setdefault("dcp", Stager()), converted)]
    if trainer.global_rank == 0:
        out.append((manager.stagers.setdefault(META_NAME, Stager()), state))
    return out


# --- FSDP2 (DCP) ----------------------------------------------------------------------------
def dcp_save(state: dict[str, Any], path: Path, writers: WriterGroup) -> None:
    """``torch.distributed.checkpoint.save`` as Lightning calls it, over the writer group."""
    _dcp_save(state, path, writers.group, alone=writers.group is None)


def _stage_dcp(manager: Any, trainer: Any, root: Path) -> Callable[[], None]:
    converted, state = fsdp_parts(trainer)
    rank = trainer.global_rank
    shards = manager.stagers.setdefault("dcp", Stager()).stage(converted)
    meta = manager.stagers.setdefault(META_NAME, Stager()).stage(state) if rank == 0 else None
    del state, converted
    root.mkdir(parents=True, exist_ok=True)
    writers = manager.writers

    def write() -> None:
        dcp_save(shards, root, writers)  # every rank's __R_0.distcp, then rank 0's .metadata
        for path in sorted(root.glob(f"__{rank}_*.distcp")):
            faults.point("checkpoint.wrote", file=path.name, rank=rank)
            fsync_file(path)
        if rank == 0:
            save_file(meta, root / META_NAME, rank)

    return write
