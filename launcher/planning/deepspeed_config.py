"""DeepSpeed JSON from the spec and the topology. Pure.

The batch triple must satisfy DeepSpeed's own check:
``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
"""

from __future__ import annotations

from typing import Any

from lmcore.job.spec import JobSpec

# Bucket sizes in elements. 5e8 is DeepSpeed's default for stage 1/2; stage 3 uses the
# usual "auto"-equivalent values scaled for a 7B-class model on 80 GB GPUs.
_REDUCE_BUCKET = 500_000_000
_ALLGATHER_BUCKET = 500_000_000
_STAGE3_PREFETCH = 50_000_000
_STAGE3_PARAM_PERSISTENCE = 100_000
_STAGE3_MAX_LIVE = 1_000_000_000


def render_deepspeed(spec: JobSpec, *, world_size: int, grad_accum: int) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO run (the planner asks only for one)."""
    t = spec.trainer
    zero: dict[str, Any] = {
        "stage": t.zero_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": _REDUCE_BUCKET,
    }
    if t.zero_stage in (1, 2):
        zero["allgather_partitions"] = True
        zero["allgather_bucket_size"] = _ALLGATHER_BUCKET
    if t.zero_stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": _STAGE3_PREFETCH,
                "stage3_param_persistence_threshold": _STAGE3_PARAM_PERSISTENCE,
                "stage3_max_live_parameters": _STAGE3_MAX_LIVE,
                "stage3_max_reuse_distance": _STAGE3_MAX_LIVE,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}

    config: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": spec.data.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,  # Lightning logs; DeepSpeed's own prints stay quiet
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on by default and synchronises the device at the start
        # and end of every micro step (under Lightning, which hands the engine no dataloader, it
        # times every forward): two host syncs per step for a figure lmtrain does not read.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "zero_allow_untested_optimizer": True,
    }
    if t.gradient_clip_val is not None:
        config["gradient_clipping"] = t.gradient_clip_val
    if t.precision == "bf16-mixed":
        # no step skipped on a non-finite norm, as under DDP and FSDP2 (bf16 has no loss scale):
        # DeepSpeed's check reads a flag and the norm on the host every step (lmtrain.distributed.zero_syncs)
        config["bf16"] = {"enabled": True, "check_grad_overflow": False}
    elif t.precision == "16-mixed":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if config["train_batch_size"] != spec.data.micro_batch_size * grad_accum * world_size:
        raise ValueError("internal: DeepSpeed batch triple does not multiply out")  # plan checked it
    return config
