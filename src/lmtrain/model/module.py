"""The LightningModule: causal-LM loss, AdamW with weight-decay groups, LR schedule, clipping
and step metrics that cost no host sync except on logging steps.

Gradient clipping is done here, not by the Trainer's ``gradient_clip_val``:

- Lightning refuses ``gradient_clip_val`` with an optimizer that unscales gradients itself
  (``AdamW(fused=True)`` under 16-mixed), and fused AdamW is the fastest CUDA implementation.
  So the Trainer gets no ``gradient_clip_val`` and ``on_before_optimizer_step`` clips with
  ``torch.nn.utils.clip_grad_norm_(foreach=True)`` (one fused kernel pass, no host sync; the
  returned norm stays on the device until a logging step reads it).
- Under 16-mixed the GradScaler must unscale before clipping; Lightning unscales before
  ``on_before_optimizer_step`` only for optimizers that do not unscale themselves, so 16-mixed
  uses the foreach (not fused) AdamW. bf16-mixed and 32-true on CUDA use fused AdamW.
- FSDP2 shards gradients as DTensors: ``clip_grad_norm_`` reduces the norm over the shards
  (the result is a DTensor; its full value is read on logging steps).
- DeepSpeed clips itself from its config (``gradient_clipping``); its norm is read from the engine.
- On CPU AdamW runs with ``foreach=True``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lmcore.job.lr_schedule import OptimSettings, lr_at
from lmcore.job.parallelism import Parallelism
from lmcore.job.spec import ModelSpec
from lmtrain.model.causal_lm import (
    ModelShape,
    build_model,
    compile_model,
    model_settings,
    model_shape,
    peak_flops_per_device,
)
from lmtrain.model.fsdp2 import shard_fsdp2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decay for matrices and embeddings (ndim >= 2); none for 1-D tensors
    (biases, LayerNorm/RMSNorm weights). Tied weights appear once."""
    decay: list[Any] = []
    no_decay: list[Any] = []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        # ZeRO-3 flattens partitioned params to 1-D; ds_shape keeps the real shape.
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@dataclass(frozen=True)
class RuntimeSettings:
    """How the module runs: strategy-dependent choices made by the entry."""

    parallelism: Parallelism  # how the model is split over this attempt's ranks (lmcore.job.parallelism)
    precision: str
    accelerator: str  # cpu | gpu
    clip_val: float | None
    seq_len: int
    micro_batch_size: int
    accumulate: int
    log_every_n_steps: int
    offload_optimizer: bool = False


class LMModule(pl.LightningModule):
    def __init__(self, model_spec: ModelSpec | Mapping[str, Any], optim: OptimSettings, rt: RuntimeSettings,
                 seed: int) -> None:
        super().__init__()
        self.model_spec = model_settings(model_spec)
        self.optim_settings = optim
        self.rt = rt
        self.seed = seed
        self.model: nn.Module | None = None
        self.shape: ModelShape | None = None
        # Step metrics live on the device between logging steps (no .item() per step).
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._grad_norm: torch.Tensor | None = None
        self._last_log_time: float | None = None
        self._last_log_step: int | None = None
        self._seen_step: int | None = None
        self._resumed_window: dict[str, Any] | None = None  # the checkpoint's loss_window(), until training starts
        self._peak_flops: float | None = None
        self.last_metrics: dict[str, float | None] = {}
        # Set by the entry: called with each logging step's metrics (the heartbeat), and the
        # train sampler whose consumed position advances once per micro batch.
        self.metrics_sink: Callable[[dict[str, Any], int], None] | None = None
        self.data_sampler: Any = None
        # pipeline parallelism (lmtrain.model.pipeline): a schedule runs forward and backward of the
        # microbatches itself, so the module steps its optimizer by hand (Lightning's manual optimization)
        self.pipeline: Any = None
        self.automatic_optimization = rt.parallelism.pipeline == 1

    # --- model ---------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from lmtrain.model.masks import never_packed

        never_packed()  # no host sync per forward in transformers' mask preparation
        model = build_model(self.model_spec, seed=self.seed)
        self.shape = model_shape(model)
        if self.model_spec.compile:
            model = compile_model(model, loss=self.rt.parallelism.compiles_loss)
        if self.rt.parallelism.pipeline > 1:
            from lmtrain.model import pipeline

            self.pipeline = pipeline.parallelize(model, self.device_mesh, self.rt.parallelism, self.rt.precision,
                                                 self.trainer.strategy.root_device)
        elif self.rt.parallelism.fsdp:  # self.device_mesh: set by ModelParallelStrategy
            if self.rt.parallelism.tensor > 1:
                self._split(model)
            shard_fsdp2(model, self.device_mesh["data_parallel"], self.rt.precision)
        self.model = model

    def _split(self, model: nn.Module) -> None:
        """Tensor (and sequence) parallelism over the mesh's tensor dimension, before FSDP2 shards
        over its data dimension. A pretrained model is only checked here (validate checks the rest)."""
        from lmtrain.model import tensor_parallel

        par = self.rt.parallelism
        found = tensor_parallel.problems(model, par.tensor, sequence_parallel=par.sequence_parallel, seq_len=self.rt.seq_len)
        if found:
            raise RuntimeError("; ".join(found))
        tensor_parallel.parallelize(model, self.device_mesh["tensor_parallel"],
                                    sequence_parallel=par.sequence_parallel)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        assert self.model is not None, "configure_model builds the model first"
        if self.rt.parallelism.sequence_parallel:  # each rank embeds a slice: the positions are the whole sequence's
            from lmtrain.model.tensor_parallel import position_ids

            return self.model(input_ids=input_ids, labels=labels, position_ids=position_ids(input_ids), use_cache=False)
        return self.model(input_ids=input_ids, labels=labels, use_cache=False)

    def _loss(self, batch: Any) -> torch.Tensor:
        input_ids, labels = unpack_batch(batch)
        # input_ids, labels: (B, T); transformers shifts the labels inside the loss.
        return self(input_ids, labels=labels).loss

    # --- training --------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.data_sampler is not None:
            self.data_sampler.advance()  # this micro batch is consumed (checkpointed position)
        if self.pipeline is not None:
            return self._pipeline_step(batch)
        loss = self._loss(batch)
        d = loss.detach()
        self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        self._loss_count += 1
        if self.rt.parallelism.zero and self.rt.accumulate > 1:
            # Lightning divides the returned loss by accumulate_grad_batches, and DeepSpeed's
            # engine.backward divides it by gradient_accumulation_steps again: gradients (and the
            # norm that gradient_clipping compares) would be 1/accumulation of the mean gradient.
            # Undo Lightning's division so DeepSpeed's own gives the mean, as DDP and FSDP have it.
            return loss * self.rt.accumulate
        return loss

    def _pipeline_step(self, batch: Any) -> torch.Tensor:
        """One optimizer step of a pipeline: the schedule runs every microbatch's forward and
        backward (the loss lives on the last stage's ranks: zero elsewhere), then the step."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        input_ids, labels = unpack_batch(batch)
        loss = self.pipeline.step(input_ids, labels)
        d = loss.detach() if loss is not None else torch.zeros((), device=input_ids.device)
        self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        self._loss_count += 1
        optimizer.step()  # the module's on_before_optimizer_step clips first
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return d

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.rt.parallelism.zero or self.rt.clip_val is None:  # DeepSpeed's engine clips
            return
        if self.pipeline is not None:  # every stage's gradients: one norm over the pipeline's ranks
            from lmtrain.model.tensor_parallel import clip_grad_norm_ as clip_over_meshes

            # a tied embedding's two copies hold one summed gradient: counted once, as DDP counts it
            group = self.device_mesh["pipeline"].get_group()
            self._grad_norm = clip_over_meshes(self.parameters(), self.rt.clip_val, across=group,
                                               uncounted=self.pipeline.duplicates)
            return
        if self.rt.parallelism.tensor > 1:  # parameters on two meshes: one norm over both
            from lmtrain.model.tensor_parallel import clip_grad_norm_

            self._grad_norm = clip_grad_norm_(self.parameters(), self.rt.clip_val)
            return
        # foreach=None: the multi-tensor kernel on CUDA; the result stays a device tensor.
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), self.rt.clip_val)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Called per micro batch; act once per optimizer step, on logging steps only.
        # Losses keep summing on the device between logging steps (the logged loss is the
        # mean over the window).
        step = self.trainer.global_step
        if step == self._seen_step:
            return  # still accumulating gradients
        self._seen_step = step
        if self._logs_at(step):
            self._log_step_metrics(step)

    def _logs_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` is a logging step."""
        return step % self.rt.log_every_n_steps == 0 or step == self.trainer.max_steps

    def _log_step_metrics(self, step: int) -> None:
        now = time.perf_counter()
        assert self._loss_sum is not None
        loss = (self._loss_sum / self._loss_count).float()
        if self.trainer.world_size > 1:
            # the mean over the ranks; a pipeline's loss is on its last stage's ranks only (1 in pp)
            loss = self.trainer.strategy.reduce(loss, reduce_op="mean") * self.rt.parallelism.pipeline
        grad_norm = self._read_grad_norm()
        metrics: dict[str, float | None] = {
            "loss": float(loss.item()),  # the one host sync, on logging steps only
            "lr": float(self.trainer.optimizers[0].param_groups[0]["lr"]),
            "grad_norm": grad_norm,
            "tokens_per_s": None,
            "mfu": None,
        }
        if self._last_log_time is not None and self._last_log_step is not None and step > self._last_log_step:
            steps = step - self._last_log_step
            tokens = (steps * self.rt.micro_batch_size * self.rt.seq_len * self.rt.accumulate
                      * self.rt.parallelism.data_parallel_size)  # tensor-parallel ranks share their samples
            tps = tokens / max(now - self._last_log_time, 1e-9)
            metrics["tokens_per_s"] = tps
            if self._peak_flops and self.shape is not None:
                per_device = tps / self.rt.parallelism.world_size
                metrics["mfu"] = per_device * self.shape.flops_per_token(self.rt.seq_len) / self._peak_flops
        self._last_log_time = now
        self._last_log_step = step
        self._loss_sum, self._loss_count = None, 0
        self.last_metrics = {"step": step, **metrics}
        if self.metrics_sink is not None:
            self.metrics_sink(self.last_metrics, self.trainer.max_steps)
        self.log_dict(
            {f"train/{k}": v for k, v in metrics.items() if v is not None},
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
            batch_size=self.rt.micro_batch_size,
        )

    def _read_grad_norm(self) -> float | None:
        if self.rt.parallelism.zero:
            engine = self.trainer.strategy.model
            norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
            return None if norm is None else float(norm)
        if self._grad_norm is None:
            return None
        norm = self._grad_norm
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        return float(norm.item())

    def on_train_start(self) -> None:
        self._peak_flops = peak_flops_per_device(self.rt.precision)
        self._last_log_time = time.perf_counter()
        self._last_log_step = self.trainer.global_step
        self._seen_step = self.trainer.global_step
        window, self._resumed_window = self._resumed_window, None
        if window is not None and window.get("count"):
            self._loss_sum, self._loss_count = window["sum"].to(self.device), int(window["count"])

    # --- the logging window across a stop ----------------------------------------------
    def loss_window(self) -> dict[str, Any]:
        """This rank's loss window as it stands once this step is logged (a checkpoint, saved in
        the callbacks' batch end, comes before the module's): saved with the checkpoint, so that
        the run resumed from it logs the mean over the same steps as the run that did not stop."""
        step = self.trainer.global_step
        if (step != self._seen_step and self._logs_at(step)) or self._loss_sum is None:  # logged next: empty
            return {"sum": None, "count": 0}
        return {"sum": self._loss_sum.detach().cpu(), "count": self._loss_count}

    def resume_loss_window(self, window: dict[str, Any] | None) -> None:
        """The saved loss_window() of this rank (same world size only), taken up when training starts."""
        self._resumed_window = window

    # --- validation --------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.pipeline is not None:  # the last stage's ranks hold the loss: x pp, so the ranks' mean is it
            input_ids, labels = unpack_batch(batch)
            got = self.pipeline.evaluate(input_ids, labels)
            loss = (got.detach() if got is not None else torch.zeros((), device=input_ids.device))
            loss = loss * self.rt.parallelism.pipeline
        else:
            # Compiled blocks run eagerly here: validation (Lightning's sanity check first, under
            # no_grad) would otherwise compile an inference graph of every compiled function and
            # training would compile it again (dynamo's guard on grad_mode: bench/graph_breaks.py)
            with torch.compiler.set_stance("force_eager") if self.model_spec.compile else contextlib.nullcontext():
                loss = self._loss(batch)
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=self.rt.micro_batch_size)
        return loss

    # --- optimizer ----------------------------------------------------------------------
    def configure_optimizers(self):
        s = self.optim_settings
        groups = param_groups(self.model, s.weight_decay)
        optimizer = self._make_optimizer(groups)
        # LambdaLR multiplies the base lr; the schedule is defined in absolute lr.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_at(i, s) / s.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def _make_optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        s = self.optim_settings
        kwargs = {"lr": s.lr, "betas": s.betas, "eps": s.eps}
        if self.rt.parallelism.zero and self.rt.offload_optimizer:
            # ZeRO-Offload refuses a torch optimizer (zero_force_ds_cpu_optimizer): its CPU Adam
            # does the step on the host.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        if self.rt.accelerator == "gpu":
            fused = not self.rt.precision.startswith("16")  # see the module docstring
            return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **kwargs)
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept {'input_ids', 'labels'} dicts, (input_ids, labels) tuples or a bare (B, T) tensor."""
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        return ids, batch.get("labels", ids)
    if isinstance(batch, (tuple, list)):
        return batch[0], batch[1] if len(batch) > 1 else batch[0]
    return batch, batch
