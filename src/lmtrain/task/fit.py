"""Data, model, callbacks, loggers and the Trainer of one attempt, built from the plan, and the
fit itself (:mod:`lmtrain.task.training` runs it). Resuming restores this rank's data position and
RNG streams; on another world size the data is re-sharded, the RNG streams start fresh and the
gradient accumulation is realigned (:mod:`lmtrain.checkpoint.elastic` for the weights)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lmtrain.observe.attempt import Outcome
from lmtrain.observe.startup import CLOCK

if TYPE_CHECKING:
    from lmcore.job.plan import LaunchPlan
    from lmcore.run.checkpoint_index import CompleteCheckpoint
    from lmtrain.distributed.task_env import TaskEnv
    from lmtrain.observe.attempt import AttemptRecords
    from lmtrain.preemption.controller import Preemption

log = logging.getLogger("lmtrain")


class Fit:
    """One attempt's Trainer and what it trains, on one rank."""

    def __init__(self, plan: LaunchPlan, env: TaskEnv, ctl: Preemption, records: AttemptRecords,
                 ckpt: CompleteCheckpoint | None, rank_state: dict[str, Any] | None) -> None:
        self.plan, self.env, self.ctl, self.records = plan, env, ctl, records
        self.ckpt, self.rank_state = ckpt, rank_state
        self.job = plan.job_spec()  # typed: checkpoint, logging, data, trainer, watchdog settings
        self.resume_rng: Any = None
        self.resume_window: dict[str, Any] | None = None
        self.realign: Any = None
        self.universal = False
        self.validate = False
        # how the model is split, on this attempt's world (a local run may differ from the plan's)
        self.parallelism = plan.parallelism.with_world(env.world_size)

    # -- building ----------------------------------------------------------------------------
    def trainer_for(self, startup: Any) -> pl.Trainer:
        """Data, model, callbacks and the Trainer (the ``data`` and ``model`` startup phases)."""
        from lmtrain.checkpoint.elastic import needs_universal
        from lmtrain.distributed.strategies import bound_devices, build_strategy, trainer_plugins

        plan, env = self.plan, self.env
        self.loaders = self._data()
        # a ZeRO checkpoint resumed by ZeRO on another world size: the engine loads its universal form
        self.universal = self.ckpt is not None and needs_universal(self.ckpt, self.parallelism) and self.parallelism.zero
        CLOCK.mark("data")
        self.module = self._module()
        # The plan's Trainer arguments as they are (the dry run printed them); without a
        # validation split in the data, the same arguments with validation off.
        trainer_plan = plan.trainer if self.loaders[1] is not None else plan.trainer.without_validation()
        self.trainer_plan = trainer_plan
        self.validate = trainer_plan.val_check_interval is not None
        from lmtrain.observe.loggers import make_loggers

        loggers = make_loggers(plan.paths.run_dir, self.job.logging, plan.run_name,
                               resume_step=self.ckpt.step if self.ckpt else None)
        strategy = build_strategy(plan, env, load_universal=self.universal, source=self._other_format())
        trainer = pl.Trainer(
            **bound_devices(strategy, trainer_plan.kwargs(), plan, env),
            strategy=strategy,
            plugins=trainer_plugins(strategy, env),
            enable_model_summary=env.rank == 0,
            logger=loggers or False,
            callbacks=self.callbacks(startup),
        )
        from lmtrain.preemption.agreement import without_lightnings_sigterm_broadcast

        without_lightnings_sigterm_broadcast(trainer)  # the stop is agreed by lmtrain at step boundaries
        CLOCK.mark("model")
        return trainer

    def _other_format(self) -> Any:
        """The checkpoint resumed, when another strategy's format wrote it (lmtrain.checkpoint.cross_format)."""
        from lmcore.job.parallelism import Parallelism
        from lmtrain.checkpoint.cross_format import Source, converts
        from lmtrain.checkpoint.manager import universal_dir

        if self.ckpt is None:
            return None
        old = Parallelism.of_meta(self.ckpt.meta())
        if not converts(old, self.parallelism):
            return None
        return Source(self.job.model, universal_dir(self.ckpt) if old.zero else None)

    def _data(self) -> tuple[Any, Any, Any]:
        """The loaders and the sampler, at this rank's data position when resuming."""
        from lmtrain.data.loader import TokenData, make_dataloaders
        from lmtrain.model.causal_lm import build_config

        plan, env, ckpt, data_spec = self.plan, self.env, self.ckpt, self.job.data
        vocab = getattr(build_config(self.job.model), "vocab_size", None)
        if vocab is not None:
            for store in data_spec.stores:  # a mixture: each store named when it does not fit
                TokenData(store.path).check_vocab(int(vocab))
        # Tensor-parallel ranks (consecutive global ranks, Lightning's (dp, tp) mesh) read the same
        # samples: the data is sharded over the data-parallel ranks only.
        par = self.parallelism
        batch = par.loader_batch(plan.topology.micro_batch_size)
        if batch != data_spec.micro_batch_size:  # a pipeline: a step's microbatches in one batch
            data_spec = data_spec.model_copy(update={"micro_batch_size": batch})
        train_loader, val_loader, sampler = make_dataloaders(
            data_spec, world_size=par.data_parallel_size, rank=par.data_rank(env.rank), seed=plan.training.seed,
            val_drop_last=par.pipeline > 1)
        self.ctl.guard_workers(train_loader, val_loader)  # workers ignore SIGTERM / the warning
        if ckpt is not None:
            state = self.rank_state if self.rank_state is not None else ckpt.rank_state(0)
            if state is None:
                raise RuntimeError(f"{ckpt.path} has no rank-{env.rank}.pt nor rank-0.pt: "
                                   "not a complete lmtrain checkpoint")
            sampler.load_state_dict(state["data_sampler"])
            self._resume_streams(state)
        return train_loader, val_loader, sampler

    def _resume_streams(self, state: dict[str, Any]) -> None:
        """This rank's RNG streams on the same world size; else a realigned accumulation."""
        from lmtrain.observe.callbacks import RealignAccumulation

        env, ckpt, rank_state, topo = self.env, self.ckpt, self.rank_state, self.plan.topology
        assert ckpt is not None
        layout = (env.world_size, self.parallelism.tensor, self.parallelism.pipeline)
        if rank_state is not None and _layout(rank_state, env.world_size) == layout:
            self.resume_rng = rank_state["rng"]
            self.resume_window = rank_state.get("loss_window")  # None in checkpoints before it was kept
            return
        old_world, old_tp, old_pp = _layout(state, env.world_size)
        log.warning("resuming step-%d on %d ranks, tensor parallel %d, pipeline parallel %d (written on %d, tensor "
                    "parallel %d, pipeline parallel %d): data position re-sharded, RNG streams start fresh", ckpt.step,
                    env.world_size, self.parallelism.tensor, self.parallelism.pipeline, old_world, old_tp, old_pp)
        # Lightning's batches per step as written (states before it was kept: the micro batches then)
        old_accum = int(state.get("accumulate") or topo.global_batch_size // (topo.micro_batch_size * (old_world // old_tp)))
        self.realign = RealignAccumulation(old_accum, self.plan.trainer.accumulate_grad_batches)

    def _module(self) -> Any:
        from lmtrain.model.module import LMModule, OptimSettings, RuntimeSettings

        plan, t, data_spec = self.plan, self.plan.trainer, self.job.data
        pl.seed_everything(plan.training.seed, workers=True, verbose=False)
        rt = RuntimeSettings(
            parallelism=self.parallelism, precision=t.precision, accelerator=t.accelerator,
            clip_val=plan.training.gradient_clip_val, seq_len=data_spec.seq_len,
            micro_batch_size=self.parallelism.loader_batch(plan.topology.micro_batch_size),
            accumulate=t.accumulate_grad_batches, log_every_n_steps=t.log_every_n_steps,
            offload_optimizer=self.job.trainer.offload_optimizer,
        )
        module = LMModule(self.job.model, OptimSettings.from_spec(self.job.optim, t.max_steps), rt,
                          plan.training.seed)
        module.data_sampler = self.loaders[2]
        module.resume_loss_window(self.resume_window)
        return module

    def callbacks(self, startup: Any) -> list[Any]:
        """The Trainer's callbacks, in order: the resumed step count, the rank's step timing, startup record,
        checkpoints, the stop agreement, RNG-neutral validation, metrics (the heartbeat, and rank 0's
        Pushgateway push where the spec names one), the accumulation realigned, the hang watchdog
        (it beats after checkpoint writes), profiling on demand, the timing's boundary mark (last);
        a search trial's rank 0 also reports its metric to the study (lmtrain.observe.trial_report)."""
        from lmtrain.observe.callbacks import AlignStepCount, MetricsHeartbeat, RngNeutralValidation

        ckpt_cb = self._checkpoint_callback()
        metrics_cb = MetricsHeartbeat(self.records.heartbeat, every_n_steps=self.job.logging.heartbeat_every_n_steps)
        pusher = self._pusher()
        sinks = [metrics_cb.step_metrics] + ([pusher.step_metrics] if pusher is not None else [])
        self.module.metrics_sink = lambda metrics, max_steps: [sink(metrics, max_steps) for sink in sinks]
        trial = self._trial_report()
        if trial is not None:
            sinks.append(trial.step_metrics)
        timing = self._rank_timing()
        callbacks = [timing, startup, ckpt_cb, self.ctl.callback(ckpt_cb), RngNeutralValidation(), metrics_cb,
                     *([pusher] if pusher is not None else []), *([trial] if trial is not None else []),
                     self._memory_record(),
                     *([self.realign] if self.realign else [])]
        # the step count set before any callback reads it (a checkpoint of the other optimization loop)
        aligned = [AlignStepCount(self.ckpt.step)] if self.ckpt is not None else []
        return aligned + callbacks + self._watchdog() + [self._profiling(), timing.boundary_mark()]

    def _pusher(self) -> Any:
        """Rank 0's Pushgateway pusher when the spec names one (lmtrain.observe.pushgateway)."""
        spec = self.job.logging.pushgateway
        if spec is None or self.env.rank != 0:
            return None
        from lmtrain.observe.pushgateway import Pusher

        return Pusher(spec.url, run=self.plan.run_name, attempt=self.records.attempt, every_n_steps=spec.every_n_steps)

    def _trial_report(self) -> Any:
        """Rank 0's report to its search's study when this run is a trial (lmtrain.observe.trial_report)."""
        if self.plan.trial is None or self.env.rank != 0:
            return None
        from lmtrain.observe.trial_report import TrialReport

        return TrialReport(self.plan.trial, self.ctl.stop.request)

    def _profiling(self) -> Any:
        """torch.profiler on demand (`lmlaunch profile`) or over the spec's window (lmtrain.observe.profiling)."""
        from lmcore.run.rundir import RunLayout
        from lmtrain.observe.profiling import ProfileOnDemand

        layout, attempt = RunLayout.of_plan(self.plan), self.records.attempt
        from lmtrain.distributed.node_share import local_copy

        return ProfileOnDemand(local_copy(layout.profile_request), lambda request_id: layout.profile_dir(attempt, request_id),
                               attempt=attempt, rank=self.env.rank, node=self.env.node_name,
                               log_every_n_steps=self.plan.trainer.log_every_n_steps,
                               cuda=self.plan.trainer.accelerator == "gpu", spec=self.job.profile)

    def _rank_timing(self) -> Any:
        """This rank's step timing (lmtrain.observe.rank_timing); on rank 0 of a job of 2+ ranks, the
        straggler watch that scores every rank's (lmtrain.health.straggler_watch), unless the spec
        turned it off."""
        from lmcore.run.rundir import RunLayout
        from lmtrain.health.straggler_watch import watch_for
        from lmtrain.observe.rank_timing import RankTiming

        plan, env, attempt = self.plan, self.env, self.records.attempt
        watch = watch_for(plan, env, self.records, self.parallelism.peer_groups(), self._leave_slow_node)
        return RankTiming(RunLayout.of_plan(plan).node_timing(attempt, env.node_rank), rank=env.rank, node=env.node_name,
                          log_every_n_steps=self.plan.trainer.log_every_n_steps,
                          cuda=self.plan.trainer.accelerator == "gpu",
                          after_write=watch.poke if watch else None, on_close=watch.stop if watch else None)

    def _memory_record(self) -> Any:
        """Each rank's held model states (and the device's peak) into the ledger (lmtrain.model.memory_held)."""
        import time

        from lmcore.run.rundir import LedgerNote
        from lmtrain.model.memory_held import MemoryRecord

        attempt = self.records.attempt
        planned = planned_memory(self.plan.memory, self.plan.topology.world_size)

        def write(fields: dict[str, Any]) -> None:
            try:
                self.records.ledger.write(LedgerNote("memory", time.time(), {"attempt": attempt, **fields, **planned}))
            except OSError as exc:  # a measurement never costs the run
                log.warning("could not write the memory line of attempt %d: %s", attempt, exc)

        return MemoryRecord(write, start_step=self.ckpt.step if self.ckpt is not None else 0)

    def _checkpoint_callback(self) -> Any:
        from lmcore.run.checkpoint_index import checkpoint_bytes
        from lmtrain.checkpoint.callback import CheckpointCallback
        from lmtrain.checkpoint.manager import CheckpointManager
        from lmtrain.distributed.task_env import process_group_timeout
        from lmtrain.model.causal_lm import parameter_count
        from lmtrain.observe.loggers import logger_identity

        plan, env, job, ckpt = self.plan, self.env, self.job, self.ckpt
        par, sampler = self.parallelism, self.loaders[2]
        manager = CheckpointManager(
            plan.paths.checkpoint_dir, keep_last=job.checkpoint.keep_last, every_n_steps=job.checkpoint.every_n_steps,
            parallelism=par, identity={"job_id": env.job_id, "attempt": self.records.attempt,
                                       "logger": logger_identity(plan.paths.run_dir, job.logging)},
        )
        manager.collective_timeout = process_group_timeout(plan)  # the background writers' group (gloo)
        if plan.paths.checkpoint_store:  # checkpoint.dir s3://: complete ones uploaded too
            from lmcore.job.parallelism import CheckpointFormat
            from lmtrain.checkpoint.store_mirror import Publisher, StoreMirror

            sharded = par.checkpoint is not CheckpointFormat.FULL and env.world_size > 1  # every rank sends its own
            if env.rank == 0:
                manager.mirror = StoreMirror(plan, job.checkpoint.keep_last, env.world_size - 1 if sharded else 0)
                manager.mirror.catch_up(plan.paths.checkpoint_dir)
            elif sharded:
                manager.publisher = Publisher(plan, env.rank)
        # room for a first checkpoint, before there is one to measure (lmtrain.checkpoint.disk_space)
        manager.estimate = lambda: checkpoint_bytes(parameter_count(job.model)[0], par, plan.trainer.precision)
        if plan.evaluator is not None:  # an evaluator alongside: what it has still to score is kept
            from lmcore.run import eval_alongside as ev

            evaluator, run_dir = ev.EvaluatorPlan.from_json(plan.evaluator), plan.paths.run_dir
            manager.keep_also = lambda steps: ev.kept_for_evaluator(run_dir, steps, evaluator)
        return CheckpointCallback(
            manager, lambda: {"data_sampler": sampler.state_dict(), "loss_window": self.module.loss_window()},
            self.records.heartbeat,
            resume_rng=self.resume_rng, resumed_step=ckpt.step if ckpt is not None else None,
            background=job.checkpoint.async_save,
        )

    def _leave_slow_node(self, fields: dict[str, Any], text: str) -> None:
        """health.stragglers.action exclude (the straggler watch's thread, rank 0)."""
        self.ctl.leave_slow_node(str(fields.get("node") or ""), text, self.records.idle_spares())

    def _watchdog(self) -> list[Any]:
        """The hang watchdog (lmtrain.health.watchdog), unless the spec turned it off."""
        from lmtrain.health.watchdog import WatchdogCallback

        w = self.job.watchdog
        if w.hang_timeout_s is None:
            return []
        start_step = self.ckpt.step if self.ckpt is not None else 0
        return [WatchdogCallback(timeout_s=float(w.hang_timeout_s), grace_s=float(w.exit_grace_s),
                                 records=self.records,
                                 ended=lambda report: self.ctl.hang_ended(self.records, start_step, report))]

    # -- training ----------------------------------------------------------------------------
    def run(self, trainer: pl.Trainer) -> Outcome:
        """Fit (from the checkpoint, when resuming), validate the final weights when the last
        interval did not end on a validation step; how the fit ended."""
        from lmtrain.checkpoint.elastic import universal_dir

        ckpt, (train_loader, val_loader, _), stop = self.ckpt, self.loaders, self.ctl.stop
        max_steps = self.plan.trainer.max_steps
        fit_kwargs: dict[str, Any] = {}
        if ckpt is not None:
            path = universal_dir(ckpt) if self.universal else ckpt.lightning_path
            fit_kwargs = {"ckpt_path": str(path), "weights_only": True}
            log.info("resuming from %s (step %d)", path, ckpt.step)
        trainer.fit(self.module, train_dataloaders=train_loader,
                    val_dataloaders=val_loader if self.validate else None, **fit_kwargs)
        step = trainer.global_step
        if self.validate and step >= max_steps and max_steps % (self.trainer_plan.val_every_n_steps or max_steps):
            trainer.validate(self.module, dataloaders=val_loader, verbose=False)
        if stop.agreed_step is not None:
            return Outcome(reason=stop.reason or "preempted", end_step=step,
                           detail=f"{stop.detail or stop.reason}; checkpoint step-{stop.agreed_step} complete")
        if step >= max_steps:
            return Outcome(reason="completed", end_step=step)
        return Outcome(reason="crashed", end_step=step, exit_code=1,
                       detail=f"the Trainer stopped at step {step} < max_steps({max_steps})")


def _layout(state: dict[str, Any], default_world: int) -> tuple[int, int, int]:
    """(world size, tensor-parallel size, pipeline-parallel size) a rank state was written in
    (states before TP or pipelines: size 1)."""
    return (int(state.get("world_size", default_world)), int(state.get("tensor_parallel_size", 1)),
            int(state.get("pipeline_parallel_size", 1)))


def planned_memory(memory: dict[str, Any] | None, world_size: int) -> dict[str, Any]:
    """The plan's figures beside what the ranks hold (the ledger's ``memory`` line, read by the
    exporter and ``history``): one rank's model states and peak, for the world it was planned for."""
    from lmcore.job.plan import planned_model_states

    if not memory:
        return {}
    return {"planned": {"model_states": planned_model_states(memory), "peak": memory.get("peak"),
                        "world_size": world_size}}
