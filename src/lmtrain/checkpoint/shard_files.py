"""The sharded strategies' checkpoint files, streamed to disk as DDP's is (lmtrain.checkpoint.writeback).

DeepSpeed writes every file of its checkpoint through ``engine.checkpoint_engine.save(state,
path)``: :func:`stream_deepspeed_files` puts in DeepSpeed's own TorchCheckpointEngine with that
``torch.save`` going through a :class:`~lmtrain.checkpoint.writeback.WritebackStream`, so the disk writes
while DeepSpeed's state is serialised and lmtrain's closing fsync has little left.

FSDP2 saves through torch.distributed.checkpoint (DCP): :func:`dcp_save` is the ``dcp.save``
Lightning's ``ModelParallelStrategy`` makes, with DCP's file system writer streaming each
``__R_0.distcp`` the same way (:class:`StreamedFileSystem`). :func:`fsdp_parts` is that
strategy's conversion of the Lightning state (``state_dict`` and ``optimizer_<i>`` to DCP; the
rest ``torch.save``d by rank 0 as ``meta.pt``), so ``ModelParallelStrategy.load_checkpoint``
resumes what :func:`save_fsdp` and the background save (lmtrain.checkpoint.async_sharded) write.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter, save as _dcp_save
from torch.distributed.checkpoint.filesystem import FileSystem

from lmtrain import faults
from lmtrain.checkpoint.durable import fsync_file
from lmtrain.checkpoint.writeback import WritebackStream, save_streamed

META_NAME = "meta.pt"  # what Lightning writes beside DCP's files (lightning.fabric.utilities.load)


def save_file(obj: Any, path: Path, rank: int, **save_kwargs: Any) -> None:
    """``torch.save`` into ``path`` streamed to disk (as DeepSpeed and Lightning write their
    files), then fsync it."""
    with open(path, "wb") as f:
        save_streamed(obj, f, **save_kwargs)
        f.flush()
    faults.point("checkpoint.wrote", file=path.name, rank=rank)
    fsync_file(path)


# --- DeepSpeed ------------------------------------------------------------------------------
def stream_deepspeed_files(engine: Any) -> bool:
    """DeepSpeed's default checkpoint engine (TorchCheckpointEngine) replaced by one whose files
    are streamed to disk; another one (DeepSpeed's fast, decoupled or DataStates writers) is kept
    as it is: False."""
    streamed = _streamed_engine_class()
    current = engine.checkpoint_engine
    if type(current) is streamed:
        return True
    if type(current) is not streamed.__base__:
        return False
    engine.checkpoint_engine = streamed(bool(getattr(current, "zipfile_serialization", True)))
    return True


@functools.cache
def _streamed_engine_class() -> type:
    # deepspeed is imported here, not with this module: DDP and FSDP runs neither need nor pay for it
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class StreamedTorchEngine(TorchCheckpointEngine):
        """DeepSpeed's TorchCheckpointEngine whose ``torch.save`` streams the file to disk."""

        def __init__(self, zipfile_serialization: bool) -> None:
            super().__init__(None)
            self.zipfile_serialization = zipfile_serialization

        def save(self, state_dict: Any, path: str) -> None:
            with open(path, "wb") as f:
                save_streamed(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)

    return StreamedTorchEngine


# --- FSDP2 (DCP) ----------------------------------------------------------------------------
class _DcpStream(io.RawIOBase):
    """What DCP's writer uses of a file (write, tell, flush, fileno) over a WritebackStream of a
    new file."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._stream = WritebackStream(f)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._stream.write(data)

    def tell(self) -> int:
        return self._stream.pos

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def record(self) -> None:
        self._stream.record()


class StreamedFileSystem(FileSystem):
    """DCP's local file system with every file it creates streamed to disk."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as f:
            stream = _DcpStream(f)
            yield stream
            stream.record()  # whole: its checksum for the manifest


def dcp_save(state: dict[str, Any], path: Path, group: Any = None, *, alone: bool = False) -> None:
    """``torch.distributed.checkpoint.save`` as Lightning calls it (one file per rank, its
    ``.metadata`` by the coordinator, every file fsynced), over ``group`` (None: the default
    process group; ``alone``: no process group at all), every file streamed to disk."""
    writer = FileSystemWriter(path)
    writer.fs = StreamedFileSystem()
    if alone:
        _dcp_save(state, storage_writer=writer, no_dist=True)
    else:
        _dcp_save(state, storage_writer=writer, process_group=group)


def fsdp_parts(trainer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint of this rank as ``ModelParallelStrategy.save_checkpoint`` splits it:
    (what goes to DCP: ``state_dict`` and ``optimizer_<i>``, this rank's shards; the rest, which
    rank 0 writes as ``meta.pt``)."""
    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    converted = {"state_dict": state.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(state.pop("optimizer_states", []))})
    return converted, state


def save_fsdp(trainer: Any, root: Path) -> None:
    """Collective, synchronous: FSDP2's checkpoint into the directory ``root`` (every rank its
    shards, in parallel; rank 0 ``.metadata`` and ``meta.pt``)."""
    shards, meta = fsdp_parts(trainer)
    root.mkdir(parents=True, exist_ok=True)
    dcp_save(shards, root, alone=trainer.world_size == 1 or not torch.distributed.is_initialized())
    if trainer.global_rank == 0:
        save_file(meta, root / META_NAME, 0)
