"""The stop agreed by all ranks at an optimizer-step boundary, and its checkpoint
(:mod:`lmtrain.preemption` says where it sits on the path of a stop). The only module of the
package that imports Lightning."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl

from lmcore.run.checkpoint_index import step_dir_name
from lmtrain.preemption.stop_flags import AgreedStop, agreed_from, flags_of

__all__ = ["AgreedStop", "StopAgreement", "without_lightnings_sigterm_broadcast"]

log = logging.getLogger("lmtrain.preemption")


class StopAgreement(pl.Callback):
    """At every ``preemption.agree_every_n_steps``-th optimizer-step boundary: one all-reduce of
    4 numbers decides whether all ranks stop now.

    The flags live on the CPU and go through a gloo group of their own, made when training
    starts: the agreement never waits for the accelerator (no device-to-host copy of a CUDA
    tensor, which would wait for every kernel queued before it) and never queues behind the
    gradient buckets on NCCL. Its cost per step is one small CPU round trip between the ranks
    (bench/step_overhead.py measures it), 1/K of that with K = agree_every_n_steps.

    Must come after the CheckpointCallback (it uses its collective ``save``).
    """

    def __init__(self, controller: Any, checkpoints: Any) -> None:
        # controller: the attempt's lmtrain.preemption.controller.Preemption (its plan, stop, signals)
        self.controller = controller
        self.stop = controller.stop
        self.checkpoints = checkpoints
        self._seen_step: int | None = None
        self._group: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._group = _cpu_group(trainer, self.controller.plan)
        # Trainer.fit registered Lightning's SIGTERM handler (composed with ours): take over.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and getattr(connector, "received_sigterm", False):
            connector.received_sigterm = False  # ours, composed in, recorded it: we stop, not Lightning
        self.controller.signals.install()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if not self.stop.armed or step == self._seen_step:
            return  # mid-accumulation: not a step boundary
        self._seen_step = step
        if step % max(1, self.stop.check_every_n_steps) and step < trainer.max_steps:
            return
        agreed = self._exchange(trainer, pl_module, step)
        if agreed is None:
            return
        if not self.stop.requested:
            self.stop.request("peer", "another rank was asked to stop")
        log.info("stop agreed at step %d (SIGTERM: %s, warning: %s): checkpointing", step, agreed.term, agreed.warning)
        path = self.checkpoints.save_stop(trainer, step)  # staged: durable by the end of on_train_end
        agreed.checkpoint_held_s = self.checkpoints.last_held_s
        if not self.checkpoints.manager.background.in_flight:
            agreed.checkpoint_done_at = time.time()
        agreed.checkpoint_path = path or str(self.checkpoints.manager.dir / step_dir_name(step))
        self.controller.agreed = agreed
        self.stop.agreed_step = step
        self.stop.checkpoint_path = agreed.checkpoint_path
        trainer.should_stop = True
        if step < trainer.max_steps:
            # Lightning validates once more when should_stop is set (as for early stopping): not
            # on the way out of a preemption, the grace time is for the exit and the requeue.
            trainer.limit_val_batches = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the CheckpointCallback's, which waited until the stop's staged checkpoint is durable
        agreed = self.controller.agreed
        if agreed is not None and agreed.checkpoint_done_at is None:
            agreed.checkpoint_done_at = time.time()

    def _exchange(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> AgreedStop | None:
        import torch
        import torch.distributed as dist

        flags = torch.tensor(flags_of(self.controller), dtype=torch.float64)  # on the CPU: reading it back never waits for the accelerator
        if self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)  # the one collective per boundary
        return agreed_from(flags.tolist(), step)


def _cpu_group(trainer: Any, plan: Any) -> Any:
    """A gloo process group over all ranks for the stop flags (None on one rank). Every rank
    makes it at the same point (on_train_start), as torch.distributed requires."""
    import torch.distributed as dist

    from lmtrain.distributed.task_env import process_group_timeout

    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    # Its own group also when the training runs on gloo: one code path (the one tested on CPU),
    # and the flags never queue behind DDP's gradient buckets.
    return dist.new_group(backend="gloo", timeout=process_group_timeout(plan))


def without_lightnings_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Lightning (2.5+) broadcasts a SIGTERM flag from rank 0 before every micro batch of a
    multi-rank fit and reads it on the host: on GPUs a collective and a host sync each time. Its
    flag is set only by Lightning's own SIGTERM handler, which this agreement's handlers replace
    (``on_train_start``), so the flag is always 0 and the stop is agreed here, at step boundaries.
    Found by tests/unit/test_host_reads.py (two reads a step on 2 ranks)."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None
