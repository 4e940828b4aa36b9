"""lmtrain's checkpoint format: atomic, complete-marked step directories.

Layout under ``checkpoints/`` (docs/run-directory.md)::

    step-<S>/                 a finished checkpoint of global step S
      lightning.ckpt          model, optimizer, scheduler, loops (Lightning's trainer.save_checkpoint;
                              a file for DDP, a directory of shards for DeepSpeed / sharded FSDP)
      rank-<R>.pt             per-rank state: RNG states (python, numpy, torch, cuda), data position
      meta.json               step, world size, strategy, ZeRO stage, logger identity, time
      COMPLETE                written last, after every rank finished and everything was fsynced
    latest                    text: the name of the newest complete step directory (updated last)
    .step-<S>.tmp/            a checkpoint being written (ignored; removed by the next save)

Write protocol (every rank calls :meth:`CheckpointManager.save` at the same step boundary):

1. rank 0 clears ``.step-S.tmp`` and creates it; barrier;
2. ``trainer.save_checkpoint(.step-S.tmp/lightning.ckpt)`` (collective for DeepSpeed/FSDP;
   rank 0 writes for DDP); every rank writes ``rank-R.pt`` (tmp name, fsync, rename) and fsyncs
   the shard files it wrote; barrier: every rank finished its part;
3. rank 0 fsyncs the rest, writes ``meta.json``, renames ``.step-S.tmp`` -> ``step-S``, fsyncs
   the directory, writes ``COMPLETE`` (fsync), then points ``latest`` at it (tmp + rename);
   then removes checkpoints beyond ``keep_last``; barrier.

A crash at any point leaves either a ``.tmp`` directory or a ``step-S`` without ``COMPLETE``;
resume only ever considers ``step-*`` directories that contain ``COMPLETE`` (newest first),
whatever ``latest`` says. ``COMPLETE`` holds a manifest (every file and its size); a directory
whose files do not match it (a deletion that was interrupted) is not complete either. Deleting
a checkpoint first renames it to ``.trash-step-S-<pid>`` (one atomic step: it stops being a
checkpoint at once), then removes it; leftovers of interrupted saves and deletions are removed
by the next ``prune``. Everything is loaded with ``torch.load(weights_only=True)``.

Periodic saves and the stop's save run staged (``checkpoint.async_save``, on by default): step 2's
writes and step 3 move to writer threads once each rank's part is in host memory
(lmtrain.checkpoint.async_checkpoint; DeepSpeed, FSDP: lmtrain.checkpoint.async_sharded). A stop's
save holds training only for that copy; the end of training (``CheckpointCallback.on_train_end``)
waits until it is durable, and only then does the attempt end and requeue. The host buffers are
reserved at the attempt's first step boundary (:meth:`CheckpointManager.reserve`), so that even a
first save (a stop that comes before any periodic save) holds training only for the copy. The
final save of a finished run stays synchronous.

Every write, fsync, rename and marker step is a named point of the fault-injection seam
(``lmtrain.faults``, ``checkpoint.*``): the tests SIGKILL a saving process at each of them.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

from lmcore.job.parallelism import CheckpointFormat, Parallelism
from lmcore.run.checkpoint_index import (
    COMPLETE_NAME,
    LIGHTNING_NAME,
    CompleteCheckpoint,
    complete_checkpoints,  # noqa: F401  (re-exported: callers read the index through the manager)
    newest_complete,
    step_dir_name,
    temporary_dir_name,
)
from lmtrain import faults
from lmtrain.checkpoint import checksums, completion
from lmtrain.checkpoint.async_checkpoint import (
    BackgroundSave,
    Stager,
    reserve_ddp,
    reserve_in_background,
    save_ddp_in_background,
)
from lmtrain.checkpoint.async_sharded import (
    WriterGroup,
    reserve_dcp,
    reserve_zero,
    save_in_background,
    start_writers,
)
from lmtrain.checkpoint.completion import FORMAT_VERSION, UNIVERSAL_PREFIX, CheckpointError
from lmtrain.checkpoint.disk_space import (
    DiskFull,
    free_bytes,
    means_no_room,
    no_room,
    remove_partial,
    room_verdict,
)
from lmtrain.checkpoint.durable import (
    all_files,
    fsync_file,
    remove_tree,
    torch_save_atomic,
)
from lmtrain.checkpoint.shard_files import save_fsdp, stream_deepspeed_files

# A DeepSpeed checkpoint's universal form (lmtrain.checkpoint.elastic): universal-step-S beside step-S.


def universal_dir(ckpt: CompleteCheckpoint) -> Path:
    """Where lmtrain.checkpoint.elastic puts the universal form of a ZeRO checkpoint."""
    return ckpt.path.parent / f"{UNIVERSAL_PREFIX}{ckpt.path.name}"


def universal_error_path(ckpt: CompleteCheckpoint) -> Path:
    """Why the conversion of ``ckpt`` failed (written by rank 0, read by every rank)."""
    return ckpt.path.parent / f".{UNIVERSAL_PREFIX}{ckpt.path.name}.error"


def universal_complete(ckpt: CompleteCheckpoint) -> bool:
    return (universal_dir(ckpt) / COMPLETE_NAME).is_file()


def check_compatible(ckpt: CompleteCheckpoint, parallelism: Parallelism) -> None:
    """Raise CheckpointError when this attempt cannot load ``ckpt`` (or, for a ZeRO checkpoint on
    another world size or resumed by another strategy, its universal form, which
    lmtrain.checkpoint.elastic makes before the rendezvous). Another strategy's checkpoint is read
    through lmtrain.checkpoint.cross_format, except into ZeRO."""
    meta = ckpt.meta()
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt.path} has checkpoint format {meta.get('format')!r}; this lmtrain reads format {FORMAT_VERSION}"
        )
    old, world_size = Parallelism.of_meta(meta), parallelism.world_size
    old_world = old.world_size
    if parallelism.zero and not old.zero:
        raise CheckpointError(
            f"{ckpt.path} was written with strategy {old.strategy} and this attempt uses DeepSpeed ZeRO, which loads "
            f"only its own checkpoints. Resume it with trainer.strategy ddp or fsdp (with tensor or pipeline parallelism "
            f"or without: lmtrain converts the checkpoint to any of those), or export it (`lmlaunch export RUN --to hf DIR`) and "
            f"start a new run with model.pretrained: DIR."
        )
    if old.zero and (old_world != world_size or not parallelism.zero) and not universal_complete(ckpt):
        error = universal_error_path(ckpt)
        why = error.read_text().strip() if error.is_file() else "no conversion was attempted"
        raise CheckpointError(
            f"{ckpt.path} was written by DeepSpeed ZeRO-{meta.get('zero_stage')} on {old_world} ranks and this "
            f"attempt runs {parallelism.strategy} on {world_size}: ZeRO partitions load only into ZeRO at the same "
            f"world size, else through DeepSpeed's universal checkpoint, and converting it failed ({why}). Resume "
            f"with ZeRO on {old_world} ranks, or export it "
            f"(`lmlaunch export RUN --to hf DIR`) and start a new run with model.pretrained: DIR."
        )


# --- writing checkpoints ------------------------------------------------------------------
class CheckpointManager:
    """Writes and prunes complete-marked checkpoints. Every rank calls ``save`` collectively."""

    def __init__(
        self,
        ckpt_dir: str | Path,
        *,
        keep_last: int,
        every_n_steps: int,
        parallelism: Parallelism,
        identity: dict[str, Any],
    ) -> None:
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.every_n_steps = every_n_steps
        self.parallelism = parallelism  # the layout the files are written in (meta.json)
        self.identity = identity  # logger identity, job id, attempt: recorded in meta.json
        self.background = BackgroundSave()  # the periodic save in flight (lmtrain.checkpoint.async_checkpoint)
        self.stager = Stager()
        self.stagers: dict[str, Stager] = {}  # sharded: one per file this rank writes
        self.writers: WriterGroup | None = None  # the sharded writer threads' group (lmtrain.checkpoint.async_sharded)
        self.collective_timeout: Any = None  # the writer group's (a timedelta; None: torch's default)
        # the room a first checkpoint needs, before there is one to measure (bytes; None: unknown)
        self.estimate: Callable[[], int | None] | None = None
        self.on_failure: Callable[[DiskFull], None] | None = None  # a background save found no room
        # steps retention keeps beyond keep_last: what an evaluator alongside has still to score (lmcore.run.eval_alongside)
        self.keep_also: Callable[[list[int]], set[int]] | None = None
        self.completed_at = 0.0  # rank 0: perf_counter at the last COMPLETE (before pruning)
        self.mirror: Any = None  # rank 0, checkpoint.dir s3://: lmtrain.checkpoint.store_mirror.StoreMirror
        self.publisher: Any = None  # other ranks of a sharded checkpoint in s3://: store_mirror.Publisher

    def start(self, trainer: Any, *, on_failure: Callable[[DiskFull], None], background: bool) -> None:
        """Collective, when training starts: ``on_failure`` gets a background save that found no
        room; DeepSpeed's files streamed (lmtrain.checkpoint.shard_files); the sharded writers' group."""
        self.on_failure = on_failure
        if self.parallelism.zero:
            stream_deepspeed_files(trainer.strategy.deepspeed_engine)
        if background:
            start_writers(self, trainer)

    @property
    def can_save_in_background(self) -> bool:
        """DDP (rank 0 writes); DeepSpeed and FSDP once their writer group exists (``start``)."""
        return not self.parallelism.sharded_checkpoint or self.writers is not None

    def save(
        self, trainer: Any, *, step: int, rank_state: dict[str, Any], background: bool = False,
        on_complete: Callable[[Path, float, float], None] | None = None,
    ) -> tuple[Path, float]:
        """Collective: write checkpoint ``step``; returns (its path, seconds the caller was
        blocked). Synchronous: complete on return, ``on_complete(path, seconds)`` called before.
        ``background``: complete later; rank 0 calls ``on_complete`` from its writer
        thread. Either way a save still in flight is finished first (its failure for want of
        room goes to ``on_failure``). No room for this one: :class:`DiskFull` on every rank,
        nothing partial left (lmtrain.checkpoint.disk_space)."""
        self.finish_background(trainer)
        faults.set_context(step=step)  # what the checkpoint.* fault points are about
        try:
            self._check_room(trainer, step)
            if background and self.can_save_in_background:
                save_background = save_in_background if self.parallelism.sharded_checkpoint else save_ddp_in_background
                return save_background(self, trainer, step=step, rank_state=rank_state, on_complete=on_complete)
            t0 = time.perf_counter()
            path, seconds = self._save(trainer, step=step, rank_state=rank_state)
        finally:
            faults.set_context(step=None)
        if on_complete is not None and trainer.global_rank == 0:
            on_complete(path, self.completed_at - t0, seconds)  # durable at COMPLETE; pruning held training too
        return path, seconds

    def reserve(self, trainer: Any, step: int) -> None:
        """Collective, every rank once per attempt at its first step boundary (background saves
        on): the staging buffers allocated by a background thread (lmtrain.checkpoint.async_checkpoint.reserve)."""
        if self.can_save_in_background:
            take = reserve_zero if self.parallelism.zero else reserve_dcp if self.parallelism.sharded_checkpoint else reserve_ddp
            reserve_in_background(self, trainer, step, take)

    def wait(self) -> float:
        """Rank-local: finish the background save in flight, if any; seconds waited."""
        return self.background.wait()

    def finish_background(self, trainer: Any) -> DiskFull | None:
        """Collective: every rank's background save (its thread, where it has one) finished, and
        every rank told how it went anywhere: no room is returned (and given to ``on_failure``),
        another error raised, on every rank alike."""
        outcome: dict[str, Any] | None = None
        try:
            self.wait()
        except DiskFull as exc:
            outcome = {"disk_full": exc.figures}
        except Exception as exc:
            outcome = {"error": str(exc)}
        said = [outcome]
        if trainer.world_size > 1:
            if not trainer.strategy.reduce_boolean_decision(outcome is not None, all=False):
                return None
            said = [trainer.strategy.broadcast(outcome, src=r) for r in range(trainer.world_size)]  # rare
        failures = [x for x in said if x is not None]
        if not failures:
            return None
        full = [x["disk_full"] for x in failures if "disk_full" in x]
        if not full:
            raise RuntimeError("; ".join(dict.fromkeys(x["error"] for x in failures)))  # sharded: alike on all
        failed = DiskFull.from_figures(full[0])
        if self.on_failure is not None:
            self.on_failure(failed)
        return failed

    def needed_bytes(self) -> int | None:
        """Room one more checkpoint needs: the newest complete one's size, else the estimate."""
        newest = newest_complete(self.dir)
        if newest is not None:
            return newest.size_bytes()
        return self.estimate() if self.estimate is not None else None

    def _check_room(self, trainer: Any, step: int) -> None:
        """Collective: rank 0 compares the room needed with the room free; all raise alike."""
        figures = None
        if trainer.global_rank == 0:
            verdict = room_verdict(self.dir, step, self.needed_bytes(), free_bytes(self.dir))
            figures = verdict.figures if verdict is not None else None
        figures = trainer.strategy.broadcast(figures, src=0) if trainer.world_size > 1 else figures
        if figures is not None:
            raise DiskFull.from_figures(figures)

    def _settle(self, trainer: Any, err: BaseException | None, tmp: Path, final: Path, step: int) -> None:
        """Collective (and the barrier of the step it ends): when any rank's write found no room,
        rank 0 removes the partial save and every rank raises DiskFull saying which rank and why."""
        if not trainer.strategy.reduce_boolean_decision(err is not None, all=False):
            return
        mine = f"rank {trainer.global_rank}: {err}" if err is not None else None
        said: list[Any] = [mine]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            said = [None] * trainer.world_size
            torch.distributed.all_gather_object(said, mine)
        if trainer.global_rank == 0:
            remove_partial(tmp, final)
        trainer.strategy.barrier("lmtrain.checkpoint.manager.abandoned")
        how = "a write found no room: " + "; ".join(x for x in said if x)
        raise DiskFull(self.dir, step, self.needed_bytes(), free_bytes(self.dir), how)

    def _begin(self, trainer: Any, step: int) -> tuple[Path, Path]:
        final = self.dir / step_dir_name(step)
        tmp = self.dir / temporary_dir_name(step)

        checksums.forget(keep=tmp)  # the files of earlier saves are in their manifests

        def clear() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            if final.exists():  # a leftover of the same step (an older write of it): replace it
                remove_tree(final)
            tmp.mkdir()
            faults.point("checkpoint.tmp_dir_created", file=tmp.name)

        self._settle(trainer, no_room(clear, self.dir, self.needed_bytes) if trainer.global_rank == 0 else None, tmp, final, step)
        return tmp, final

    def _rank_part(self, trainer: Any, tmp: Path, step: int, rank_state: dict[str, Any]) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        torch_save_atomic({**rank_state, "step": step, "rank": rank, "world_size": world,
                           "tensor_parallel_size": self.parallelism.tensor, "pipeline_parallel_size": self.parallelism.pipeline,
                           "accumulate": getattr(trainer, "accumulate_grad_batches", None)}, tmp / f"rank-{rank}.pt")
        for path in _files_written_by(tmp, rank):
            fsync_file(path)
        checksums.write_sidecar(tmp, rank)  # what this rank wrote so far (a background save adds its shards)

    def _save(self, trainer: Any, *, step: int, rank_state: dict[str, Any]) -> tuple[Path, float]:
        t0 = time.perf_counter()
        tmp, final = self._begin(trainer, step)

        def parts() -> None:
            written_as = self.parallelism.checkpoint
            if written_as is CheckpointFormat.FULL:
                # DDP: Lightning's save without its closing barrier, so that a rank whose write
                # found no room meets the others at the agreement below, not at a barrier
                state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
                trainer.strategy.save_checkpoint(state, str(tmp / LIGHTNING_NAME))
            elif written_as is CheckpointFormat.DCP:
                save_fsdp(trainer, tmp / LIGHTNING_NAME)  # Lightning's FSDP2 save, its files streamed to disk
            else:
                trainer.save_checkpoint(str(tmp / LIGHTNING_NAME))
            faults.point("checkpoint.rank_saved", file=LIGHTNING_NAME, rank=trainer.global_rank)
            self._rank_part(trainer, tmp, step, rank_state)

        self._settle(trainer, no_room(parts, self.dir, self.needed_bytes), tmp, final, step)  # every rank finished its part
        if self.publisher is not None:  # this rank's own files to the bucket, now
            self.publisher.publish(tmp, final)
        err = no_room(lambda: self._finish(tmp, final, step, trainer.world_size), self.dir, self.needed_bytes) if trainer.global_rank == 0 else None
        self._settle(trainer, err, tmp, final, step)
        return final, time.perf_counter() - t0

    def _finish_or_remove(self, tmp: Path, final: Path, step: int, world: int, write: Any = None) -> None:
        """Rank 0's writer thread: (``write``, then) ``_finish``; no room: nothing partial left, DiskFull."""
        try:
            if write is not None:
                write()
            self._finish(tmp, final, step, world)
        except Exception as exc:
            if not means_no_room(exc, self.dir, self.needed_bytes):
                raise
            remove_partial(tmp, final)
            raise DiskFull(self.dir, step, self.needed_bytes(), free_bytes(self.dir),
                           f"a background write found no room: {exc}") from exc

    def _finish(self, tmp: Path, final: Path, step: int, world: int) -> None:
        """Rank 0, every rank's part written: make ``tmp`` the complete checkpoint ``final``."""
        completion.finish(self.dir, tmp, final, step, {**self.parallelism.meta(), "world_size": world,
                                                       "zero_stage": self.parallelism.zero_stage, **self.identity})
        self.completed_at = time.perf_counter()
        if self.mirror is not None:
            self.mirror.submit(final)  # uploaded from its own thread; kept here until it is there
        self.prune()

    def prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (and those ``keep_also`` names); drop
        stale temporaries."""
        completion.prune(self.dir, self.keep_last, self._kept_also)

    def _kept_also(self, steps: list[int]) -> set[int]:
        """Beyond keep_last: what an evaluator alongside has still to score, what is not in the bucket yet."""
        return ((self.keep_also(steps) if self.keep_also is not None else set())
                | (self.mirror.kept(steps) if self.mirror is not None else set()))


def _files_written_by(root: Path, rank: int) -> Iterator[Path]:
    """The files rank ``rank`` wrote itself (its rank file, DeepSpeed's per-rank shards)."""
    tag = f"rank_{rank}_"
    for path in all_files(root):
        if path.name == f"rank-{rank}.pt" or tag in path.name:
            yield path
