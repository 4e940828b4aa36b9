"""DeepSpeed ZeRO-1/2's optimizer step without its host syncs on every step.

An H200 run of the GPT-2 bench (bench/RESULTS.md, 2026-11-29) counted 420 host syncs in 45
non-logging ZeRO-2 steps, all inside DeepSpeed's ``DeepSpeedZeroOptimizer.step``. Each one stops
the host until the device has run everything queued, so the next kernels start late. Per step and
per parameter group:

- ``has_overflow`` reads the overflow flag, and ``step`` reads whether the norm is finite. In bf16
  this check is DeepSpeed's ``bf16.check_grad_overflow`` (on by default). The plan turns it off
  (``launcher.planning.deepspeed_config``): bf16 needs no loss scale, and DDP and FSDP2 do not
  skip a step on a non-finite norm either.
- ``get_grad_norm_direct`` masks a non-finite norm with a ``-1`` it first copies to the device
  (``mask_nan_or_inf_with_val_inplace``). Here the fill value is a Python number: no copy.
- ``unscale_and_clip_grads`` asks on the host whether the norm is valid before clipping. Here the
  norm is replaced by ``inf`` on the device where it is not (``torch.where``), which clips the
  same: bit-identical to DeepSpeed's for every norm (tests/unit/test_zero_syncs.py).

Applied by :func:`without_host_syncs` to the engine's optimizer when the strategy builds it. The
mask is DeepSpeed's for ZeRO-3 too; ZeRO-3's clip and an offloaded optimizer's are left as
DeepSpeed made them.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

PATCHED = "_lmtrain_without_host_syncs"


def mask_invalid_in_place(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` without copying ``val`` to the device."""
    input.masked_fill_(~torch.isfinite(input), val)


def unscale_and_clip_grads(self: Any, grad_groups_flat: list[Any], total_norm: Any) -> None:
    """``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` with the norm's validity settled on the
    device: an invalid norm (non-finite, or DeepSpeed's ``-1``) clips as ``inf``, as DeepSpeed's does."""
    if not torch.is_tensor(total_norm):
        return type(self).unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return None
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        clip_norm = torch.where(torch.isfinite(total_norm) & (total_norm >= 0), total_norm, math.inf)
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)
    return None


def without_host_syncs(optimizer: Any) -> bool:
    """Applies the sync-free norm mask (ZeRO 1-3) and clip (ZeRO-1/2 without offload) to the
    engine's optimizer; whether the clip was."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    for module in (stage_1_and_2, stage3):  # the modules' own names, read at each call
        module.mask_nan_or_inf_with_val_inplace = mask_invalid_in_place
    if not isinstance(optimizer, stage_1_and_2.DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    if getattr(optimizer, PATCHED, False):
        return True
    optimizer.unscale_and_clip_grads = types.MethodType(unscale_and_clip_grads, optimizer)
    setattr(optimizer, PATCHED, True)
    return True
