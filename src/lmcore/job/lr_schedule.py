"""The learning-rate schedule: a pure function of the step and the spec's optim section.

Pure (no torch): the runtime's LambdaLR follows it, and the launcher uses it to say how the
schedule changes when a run is continued to a larger ``trainer.max_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcore.job.spec import OptimSpec


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    schedule: str
    min_lr: float
    max_steps: int

    @classmethod
    def from_spec(cls, optim: OptimSpec | Mapping[str, Any], max_steps: int) -> OptimSettings:
        """From the spec's ``optim`` section (typed, or as the plan's JSON holds it)."""
        if isinstance(optim, OptimSpec):
            optim = optim.model_dump()
        return cls(
            lr=float(optim["lr"]),
            betas=(float(optim["betas"][0]), float(optim["betas"][1])),
            eps=float(optim["eps"]),
            weight_decay=float(optim["weight_decay"]),
            warmup_steps=int(optim["warmup_steps"]),
            schedule=str(optim["schedule"]),
            min_lr=float(optim["min_lr"]),
            max_steps=int(max_steps),
        )


def lr_at(step: int, s: OptimSettings) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``.

    Linear warmup from lr/warmup to lr over ``warmup_steps`` steps, then cosine or linear decay
    from lr to ``min_lr`` at ``max_steps``, or constant lr.
    """
    if s.warmup_steps > 0 and step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "constant":
        return s.lr
    decay_steps = max(1, s.max_steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / decay_steps)
    if s.schedule == "cosine":
        return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1.0 + math.cos(math.pi * progress))
    if s.schedule == "linear":
        return s.lr - (s.lr - s.min_lr) * progress
    raise ValueError(f"unknown schedule '{s.schedule}' (allowed: cosine, linear, constant)")


def extension_note(
    old_optim: dict[str, Any], new_optim: dict[str, Any], *, step: int, old_max_steps: int, new_max_steps: int
) -> str:
    """How the schedule goes on when a run that stopped after ``step`` optimizer steps continues to
    a larger max_steps: the schedule is a function of (step, max_steps), so it is recomputed over
    the new max_steps; say where that puts the rate."""
    old = OptimSettings.from_spec(old_optim, old_max_steps)
    new = OptimSettings.from_spec(new_optim, new_max_steps)
    last = lr_at(max(step - 1, 0), old)
    nxt = lr_at(step, new)
    if new.schedule == "constant" and step >= new.warmup_steps:
        how = f"the learning rate stays constant at {nxt:.3g}"
    else:
        how = (
            f"the learning-rate schedule ({new.schedule}, warmup {new.warmup_steps}) is recomputed over "
            f"max_steps {new_max_steps} instead of {old_max_steps}: step {step} ran at {last:.3g}, step "
            f"{step + 1} runs at {nxt:.3g}, and it reaches min_lr({new.min_lr:g}) at step {new_max_steps}"
        )
    return f"continuing from step {step} to trainer.max_steps({new_max_steps}); {how}"
