"""FSDP2 over a causal LM's transformer blocks (``torch.distributed.fsdp.fully_shard``), as
torchtitan applies it: each block, then the root; bf16 gathers with an fp32 reduce under
bf16-mixed; which blocks are freed after their forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmtrain.model.causal_lm import transformer_blocks


def shard_fsdp2(model: nn.Module, mesh: Any, precision: str = "32-true") -> None:
    """FSDP2: shard each transformer block, then the root (embeddings, final norm, head), over
    ``mesh`` (the data-parallel mesh); a block is gathered just before its forward/backward. As
    torchtitan does: under bf16-mixed gathered and computed in bf16, gradients reduced in fp32 (the
    fp32 shards stay what the optimizer steps and the checkpoint holds); the last block stays
    gathered after its forward, since its backward comes next. On a one-rank mesh every block stays
    gathered (:func:`reshards_after_forward`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = fsdp2_mixed_precision(precision)
    kwargs: dict[str, Any] = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
        param_dtype=policy[0], reduce_dtype=policy[1])}
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=reshards_after_forward(i, len(blocks), mesh.size()), **kwargs)
    fully_shard(model, **({"reshard_after_forward": False} if mesh.size() == 1 else {}), **kwargs)


def reshards_after_forward(block: int, blocks: int, shard_ranks: int) -> bool:
    """Whether FSDP2 frees block ``block``'s gathered parameters after its forward (and gathers
    them again for its backward). Not the last block (its backward comes next), and none where the
    shard group is one rank: freeing saves nothing there (the shard is the whole parameter) and the
    gather again costs a copy per parameter and its hooks' host time (bench/throughput.py
    ``--config host-fsdp``: FSDP2's pre-backward gathers 3.7 ms of a 92 ms CPU step)."""
    return shard_ranks > 1 and block < blocks - 1


def fsdp2_mixed_precision(precision: str) -> tuple[torch.dtype, torch.dtype] | None:
    """(param_dtype, reduce_dtype) of FSDP2's mixed-precision policy for a Trainer precision; None:
    FSDP2 gathers and reduces in the parameters' own dtype."""
    return (torch.bfloat16, torch.float32) if precision == "bf16-mixed" else None
