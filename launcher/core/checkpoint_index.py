"""Reading lmtrain's checkpoint directories without torch: which step directories are complete,
the newest one, its meta.json. The runtime (lmtrain.checkpoint) writes them and re-exports these
readers; the launcher uses them to plan a resume (world size, strategy) before queue time is
spent. The layout and the write protocol are described in lmtrain.checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("lmtrain.checkpoint")

STEP_RE = re.compile(r"step-(\d+)")  # matched with fullmatch
LIGHTNING_NAME = "lightning.ckpt"
COMPLETE_NAME = "COMPLETE"
LATEST_NAME = "latest"
# Bytes per parameter of a checkpoint with AdamW: fp32 weights + two fp32 moments (DDP, FSDP);
# DeepSpeed also keeps the fp32 master copy beside bf16/fp16 module weights.
BYTES_PER_PARAM = {"ddp": 12, "fsdp": 12, "deepspeed_mixed": 14, "deepspeed_fp32": 12}


def checkpoint_bytes(params: int, strategy: str, precision: str) -> int:
    """The size of one checkpoint (all ranks together), estimated from the parameter count: what
    ``lmlaunch doctor`` plans room for and what a save checks is free before its first one."""
    key = strategy
    if strategy == "deepspeed":
        key = "deepspeed_fp32" if precision.startswith("32") else "deepspeed_mixed"
    return params * BYTES_PER_PARAM[key]


def is_complete(path: Path) -> bool:
    """COMPLETE is there and, when it has a manifest, every file it names is there at its size.
    (A COMPLETE without a manifest, as older lmtrain wrote, is trusted as it is.)"""
    marker = path / COMPLETE_NAME
    try:
        text = marker.read_text()
    except OSError:
        return False
    try:
        files = json.loads(text).get("files")
    except (json.JSONDecodeError, AttributeError):
        return True
    if not isinstance(files, dict):
        return True
    for rel, size in files.items():
        try:
            if (path / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class CompleteCheckpoint:
    step: int
    path: Path

    @property
    def lightning_path(self) -> Path:
        return self.path / LIGHTNING_NAME

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((self.path / "meta.json").read_text())
        return meta

    def size_bytes(self) -> int:
        """The checkpoint's bytes, from its COMPLETE manifest (one small read); by walking the
        directory when the manifest is missing (older lmtrain)."""
        try:
            files = json.loads((self.path / COMPLETE_NAME).read_text()).get("files")
        except (OSError, json.JSONDecodeError, AttributeError):
            files = None
        if isinstance(files, dict):
            return sum(int(size) for size in files.values())
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        p = self.path / f"rank-{rank}.pt"
        if not p.exists():
            return None
        import torch  # the runtime's call only: the launcher never reads rank states

        state: dict[str, Any] = torch.load(p, map_location="cpu", weights_only=True)
        return state


def complete_checkpoints(ckpt_dir: str | Path) -> list[CompleteCheckpoint]:
    """Every complete checkpoint, oldest first. Directories without COMPLETE are ignored."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_RE.fullmatch(child.name)
        if m and child.is_dir() and (child / COMPLETE_NAME).is_file():
            if is_complete(child):
                found.append(CompleteCheckpoint(step=int(m.group(1)), path=child))
            else:
                log.warning("%s has COMPLETE but its files do not match its manifest: ignored", child)
    return sorted(found, key=lambda c: c.step)


def newest_complete(ckpt_dir: str | Path) -> CompleteCheckpoint | None:
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


