"""The baseline of bench/throughput.py: a hand-written PyTorch training loop.

What a careful researcher would write without any framework, for the same model, the same
batches and the same optimizer settings as the project's training path:

- the model from :func:`lmtrain.model.causal_lm.build_model` (same transformers class, same seed, so the
  same initial weights), ``torch.compile`` on CUDA;
- bf16 autocast on CUDA (fp32 master weights, as Lightning's ``bf16-mixed``); fp32 on CPU;
- AdamW with the project's weight-decay groups and LR schedule (:func:`lmtrain.model.module.param_groups`,
  :func:`lmtrain.model.module.lr_at`), ``fused=True`` on CUDA, ``foreach=True`` on CPU;
- gradient clipping to ``clip`` with ``torch.nn.utils.clip_grad_norm_`` (multi-tensor kernel,
  no host sync);
- no logging, no checkpoints, no host sync inside the timed window.

Batches come from the loader the caller passes (bench/throughput.py passes the one
:func:`lmtrain.data.loader.make_dataloaders` builds for the project path, with the same seed), so both
paths see identical token windows in the same order.

Timing: ``warmup`` steps first (compilation and allocator warm-up happen there), then
``torch.cuda.synchronize()``, ``steps`` timed steps, ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoopResult:
    seconds: float  # wall time of the timed steps (CUDA synchronized at both ends)
    steps: int
    tokens: int  # tokens trained on in the timed steps
    loss_first: float  # loss of the first step (read after the loop: no sync inside it)
    loss_last: float  # loss of the last step
    compiled: bool
    optimizer: str
    max_mem_gib: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_handwritten(
    model_spec: dict[str, Any],
    optim: Any,  # lmtrain.model.module.OptimSettings
    loader: Iterable[Any],
    *,
    device: torch.device,
    bf16: bool,
    clip: float | None,
    warmup: int,
    steps: int,
    seed: int,
    compile_model: bool | None = None,
) -> LoopResult:
    """Train ``warmup + steps`` optimizer steps (one micro batch each) and time the last ``steps``."""
    from lmtrain.model.causal_lm import build_model
    from lmtrain.model.module import lr_at, param_groups

    if steps < 1 or warmup < 1:
        raise ValueError(f"need warmup >= 1 and steps >= 1 (got warmup={warmup}, steps={steps})")
    cuda = device.type == "cuda"
    compiled = cuda if compile_model is None else compile_model
    model = build_model(model_spec, seed=seed).to(device)
    model.train()
    groups = param_groups(model, optim.weight_decay)
    kwargs = {"lr": optim.lr, "betas": optim.betas, "eps": optim.eps}
    if cuda:
        opt = torch.optim.AdamW(groups, fused=True, **kwargs)
        opt_name = "AdamW(fused=True)"
    else:
        opt = torch.optim.AdamW(groups, foreach=True, **kwargs)
        opt_name = "AdamW(foreach=True)"
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_at(i, optim) / optim.lr)
    fwd = torch.compile(model) if compiled else model
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    losses: list[torch.Tensor] = []  # device tensors; read once, after the timed window
    it = iter(loader)
    t0 = 0.0
    tokens = 0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            t0 = time.perf_counter()
        batch = next(it)
        ids = batch["input_ids"].to(device, non_blocking=True)  # (B, T)
        labels = batch["labels"].to(device, non_blocking=True)  # (B, T); the model shifts them
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = fwd(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            tokens += ids.numel()
        if i == warmup or i == warmup + steps - 1:
            losses.append(loss.detach())
    _sync(device)
    seconds = time.perf_counter() - t0
    max_mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    result = LoopResult(
        seconds=seconds, steps=steps, tokens=tokens, loss_first=float(losses[0].item()),
        loss_last=float(losses[-1].item()), compiled=compiled, optimizer=opt_name, max_mem_gib=max_mem,
    )
    del fwd, model, opt, sched, losses, it
    return result
