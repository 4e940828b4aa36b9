"""The scale harness's checkpoint: one tiny shard per rank, made complete by the real protocol.

Every rank writes ``shard-rank-<R>.bin`` (``simulate.shard_bytes`` bytes, a pattern of the step and
the rank) into the step's temporary directory, atomically and fsynced, with its checksum in its
sidecar, as a rank's ``rank-R.pt`` is written (lmtrain.checkpoint.durable, lmtrain.checkpoint.checksums);
rank 0 then completes and prunes it (lmtrain.checkpoint.completion), between the barriers of
lmtrain.checkpoint.manager's protocol. A resume verifies every file against COMPLETE's checksums
(lmtrain.checkpoint.resume_point, each rank its share) and each rank reads its own shard back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import CompleteCheckpoint, step_dir_name, temporary_dir_name
from lmtrain.checkpoint import checksums, completion
from lmtrain.checkpoint.completion import CheckpointError
from lmtrain.checkpoint.durable import remove_tree, write_bytes_atomic
from lmtrain.simulate.collective import Star


def shard_name(rank: int) -> str:
    return f"shard-rank-{rank}.bin"


def shard_bytes(step: int, rank: int, size: int) -> bytes:
    """What rank ``rank`` writes at ``step`` (and must read back when resuming from it)."""
    unit = f"step {step} rank {rank};".encode()
    return (unit * (size // len(unit) + 1))[:size]


def save(star: Star, plan: Any, env: Any, step: int, *, size: int, identity: dict[str, Any]) -> Path:
    """Collective: checkpoint ``step``; its complete directory."""
    ckpt_dir = Path(plan.paths.checkpoint_dir)
    tmp, final = ckpt_dir / temporary_dir_name(step), ckpt_dir / step_dir_name(step)
    checksums.forget(keep=tmp)
    if env.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        if final.exists():  # a leftover of the same step: replaced
            remove_tree(final)
        tmp.mkdir()
    star.barrier()
    write_bytes_atomic(tmp / shard_name(env.rank), shard_bytes(step, env.rank, size))
    checksums.write_sidecar(tmp, env.rank)
    star.barrier()  # every rank's part written
    if env.rank == 0:
        meta = {**plan.parallelism.with_world(env.world_size).meta(), "zero_stage": None, **identity}
        completion.finish(ckpt_dir, tmp, final, step, meta)
        completion.prune(ckpt_dir, plan.job_spec().checkpoint.keep_last)
    star.barrier()
    return final


def load(ckpt: CompleteCheckpoint, env: Any) -> None:
    """This rank's shard of ``ckpt`` (its checksum was verified), read back and compared."""
    world = int(ckpt.meta().get("world_size") or 0)
    if world != env.world_size:
        raise CheckpointError(f"{ckpt.path} holds the shards of {world} ranks and this attempt has {env.world_size}: "
                              "the scale harness resumes on the world size it saved")
    path = ckpt.path / shard_name(env.rank)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if data != shard_bytes(ckpt.step, env.rank, len(data)):
        raise CheckpointError(f"{path} does not hold what rank {env.rank} wrote at step {ckpt.step}")
