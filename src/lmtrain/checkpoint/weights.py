"""The full model weights of a complete checkpoint, whatever strategy wrote it, on one CPU process.

A checkpoint's ``lightning.ckpt`` is:

- DDP: one file (``trainer.save_checkpoint``): its ``state_dict``;
- FSDP2: a torch.distributed.checkpoint (DCP) directory, one ``__R_0.distcp`` shard per rank
  plus ``.metadata`` and Lightning's ``meta.pt``: the ``state_dict`` entries are read back
  whole (DCP assembles the shards; no process group needed);
- DeepSpeed ZeRO 1/2/3: DeepSpeed's directory (``latest`` + ``checkpoint/`` with
  ``mp_rank_00_model_states.pt`` and one ``zero_pp_rank_R_..._optim_states.pt`` per rank): the
  fp32 weights are rebuilt from the ZeRO partitions (DeepSpeed's zero_to_fp32), which hold the
  master weights for every stage.

Keys are the LightningModule's (``model.transformer.h.0...``); :func:`model_state_dict` strips
the ``model.`` prefix for the transformers model itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lmtrain.checkpoint.manager import LIGHTNING_NAME

log = logging.getLogger(__name__)


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint whose files cannot be read back; the message names the files at fault."""


def lightning_state_dict(ckpt_path: str | Path) -> dict[str, torch.Tensor]:
    """The LightningModule state dict stored in a checkpoint step directory (or its
    ``lightning.ckpt``), as full CPU tensors. A file that cannot be read is named in an
    :class:`UnreadableCheckpoint` (a truncated torch file, say, behind a COMPLETE marker of an
    older lmtrain that records no sizes)."""
    path = Path(ckpt_path)
    if path.name != LIGHTNING_NAME and (path / LIGHTNING_NAME).exists():
        path = path / LIGHTNING_NAME
    try:
        return _read_state_dict(path)
    except (RuntimeError, OSError, EOFError, ValueError, KeyError) as exc:
        suspects = _unreadable_files(path)
        named = "; ".join(suspects) if suspects else "no single file is at fault by its format"
        raise UnreadableCheckpoint(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:300]}): {named}") from exc


def _unreadable_files(path: Path) -> list[str]:
    """The torch files under ``path`` that are not whole: torch.save writes a zip archive, and a
    truncated or overwritten one has no readable central directory; other files that are empty."""
    import zipfile

    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    bad = []
    for f in files:
        size = f.stat().st_size
        if f.suffix in (".pt", ".ckpt") and not zipfile.is_zipfile(f):
            bad.append(f"{f} ({size:,} bytes) is not a whole torch file")
        elif size == 0:
            bad.append(f"{f} is empty")
    return bad


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    if (path / ".metadata").exists():
        return _dcp_state_dict(path)
    if (path / "latest").exists() or any(path.glob("*/mp_rank_*_model_states.pt")):
        return _zero_state_dict(path)
    raise FileNotFoundError(f"{path}: neither a checkpoint file, a DCP directory nor a DeepSpeed checkpoint")


def model_state_dict(ckpt_path: str | Path) -> dict[str, torch.Tensor]:
    """The transformers model's own state dict (the LightningModule's ``model.`` entries)."""
    full = lightning_state_dict(ckpt_path)
    return {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}


def _dcp_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(str(path)),
        planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}),
        no_dist=True,
    )
    return {k: v for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}


def _zero_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # Lightning wraps the module: DeepSpeed names parameters "_forward_module.<name>".
    state = get_fp32_state_dict_from_zero_checkpoint(str(path))
    return {k.partition("_forward_module.")[2] or k: v for k, v in state.items()}
