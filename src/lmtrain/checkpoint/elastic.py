"""Resuming a DeepSpeed ZeRO checkpoint on another data-parallel world size.

ZeRO's optimizer (and for stage 3, parameter) partitions load only at the world size that wrote
them. DeepSpeed's universal checkpoint is the way across: ``ds_to_universal`` turns the
partitions into one file per parameter (fp32 weights, Adam's exp_avg / exp_avg_sq, step), and an
engine configured with ``"checkpoint": {"load_universal": true}`` loads those at any world size.
(DDP checkpoints hold full tensors and FSDP2's DCP shards are resharded by DCP itself: neither
needs this.)

Rank 0 converts before the rendezvous, so every rank finds the result when it resumes:

    checkpoints/step-S/                   the ZeRO checkpoint, untouched
    checkpoints/universal-step-S/         its universal form (not a step-* name: never resumed
      latest, latest_universal, <tag>/     from directly, removed with step-S by the pruning)
      COMPLETE                            written last

The conversion runs in a child process (DeepSpeed's own tool) into ``.universal-step-S.tmp``,
which is renamed when complete: a crash leaves a temporary that the next attempt redoes.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lmcore.job.parallelism import Parallelism
from lmcore.run.checkpoint_index import COMPLETE_NAME
from lmtrain.checkpoint.durable import fsync_dir, write_text_atomic
from lmtrain.checkpoint.manager import CompleteCheckpoint, universal_complete, universal_dir, universal_error_path

log = logging.getLogger(__name__)

DONE_NAME = COMPLETE_NAME


def needs_universal(ckpt: CompleteCheckpoint, parallelism: Parallelism) -> bool:
    """A DeepSpeed checkpoint resumed by DeepSpeed on another world size, or by another strategy
    (lmtrain.checkpoint.cross_format reads the universal form)."""
    old = Parallelism.of_meta(ckpt.meta())
    return old.zero and (not parallelism.zero or old.world_size != parallelism.world_size)


def ensure_universal(ckpt: CompleteCheckpoint) -> Path:
    """Rank 0: the universal form of ``ckpt`` (converted now unless it already is)."""
    out = universal_dir(ckpt)
    if universal_complete(ckpt):
        return out
    universal_error_path(ckpt).unlink(missing_ok=True)
    source = ckpt.lightning_path
    tag = (source / "latest").read_text().strip()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)  # an earlier conversion without its marker
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    log.warning("converting %s (ZeRO, %s ranks) to a universal checkpoint for %s", ckpt.path,
                ckpt.meta().get("world_size"), out)
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
         "--input_folder", str(source / tag), "--output_folder", str(tmp / tag), "--inject_missing_state"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"converting {ckpt.path} to a universal checkpoint failed (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr)[-3000:]}"
        )
    # DeepSpeed reads `latest_universal` when load_universal is set; Lightning checks `latest`.
    write_text_atomic(tmp / "latest_universal", tag)
    write_text_atomic(tmp / "latest", tag)
    fsync_dir(tmp)
    tmp.rename(out)
    fsync_dir(out.parent)
    write_text_atomic(out / DONE_NAME, f"{ckpt.step}\n")
    log.warning("universal checkpoint ready in %.1f s: %s", time.perf_counter() - started, out)
    return out


def record_failure(ckpt: CompleteCheckpoint, text: str) -> None:
    """Why the conversion failed, for the message every rank gives (check_compatible)."""
    write_text_atomic(universal_error_path(ckpt), text[-2000:])
