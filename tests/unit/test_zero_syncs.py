"""lmtrain.distributed.zero_syncs: DeepSpeed ZeRO-1/2's norm mask and clip without host syncs compute
what DeepSpeed's own do, bit for bit, for every kind of norm (finite under and over the clip, inf,
NaN, DeepSpeed's -1 for an invalid group); the engine the strategy builds has them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

deepspeed_zero = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
from deepspeed.runtime import utils as ds_utils

from lmtrain.distributed import zero_syncs

NORMS = [0.5, 3.0, 1e30, float("inf"), float("nan"), -1.0]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
def test_the_clip_is_deepspeeds_bit_for_bit(norm, loss_scale, clip_grad):
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(257, generator=gen), [torch.randn(64, generator=gen), torch.randn(3, generator=gen)]]
    theirs = [g.clone() if torch.is_tensor(g) else [x.clone() for x in g] for g in grads]
    ours = [g.clone() if torch.is_tensor(g) else [x.clone() for x in g] for g in grads]
    opt = SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device=torch.device("cpu"))
    deepspeed_zero.DeepSpeedZeroOptimizer.unscale_and_clip_grads(opt, theirs, torch.tensor(norm))
    zero_syncs.unscale_and_clip_grads(opt, ours, torch.tensor(norm))
    a, b = (torch.cat([g if torch.is_tensor(g) else torch.cat(g) for g in gs]) for gs in (ours, theirs))
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_the_mask_is_deepspeeds_without_a_tensor_made_on_the_host():
    values = torch.tensor([2.5, float("inf"), float("nan"), float("-inf"), -1.0, 0.0])
    theirs, ours = values.clone(), values.clone()
    ds_utils.mask_nan_or_inf_with_val_inplace(theirs, device=theirs.device)
    made = []
    real_tensor = torch.tensor
    try:
        torch.tensor = lambda *a, **k: made.append(a) or real_tensor(*a, **k)  # type: ignore[assignment]
        zero_syncs.mask_invalid_in_place(ours, device=ours.device)
    finally:
        torch.tensor = real_tensor  # type: ignore[assignment]
    assert torch.equal(ours, theirs) and made == []
