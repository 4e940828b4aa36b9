"""Test helper run as each local rank: the real lmtrain entry, plus a callback that asks the
run to stop at a given optimizer step (as a preemption signal handler would), so that the
stop -> collective agreement -> checkpoint -> exit path runs for real.

usage: python _train_with_stop.py RUN_DIR STOP_AT_STEP   (STOP_AT_STEP 0: never)

Rank 0 also writes what the Trainer was built with, read back from the Trainer
(``RUN_DIR/trainer-args.json``), the config the DeepSpeed engine was initialised with (``engine.config``) to
``RUN_DIR/engine-deepspeed.json`` when the strategy is DeepSpeed, and, when training ends, the
trained model's logits on a fixed input (every rank takes part in the forward: ZeRO-3 and FSDP
gather their shards) to ``RUN_DIR/final-logits.pt``, with the model shape MFU is computed from.
"""

import dataclasses
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from _extra_callbacks import run_task_with


def main() -> int:
    run_dir, stop_at = sys.argv[1], int(sys.argv[2])

    def setup(ctx):
        ctx.stop.armed = True

        class RequestStop(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                # Only rank 0 is "signalled": the others learn it through the agreement.
                if stop_at and trainer.global_step == stop_at - 1 and trainer.global_rank == 0:
                    ctx.stop.request("preempted", "test: stop requested")

        class DumpEngineConfig(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                engine = trainer.strategy.model
                if trainer.global_rank == 0 and hasattr(engine, "config") and hasattr(engine, "zero_optimization_stage"):
                    Path(run_dir, "engine-deepspeed.json").write_text(json.dumps(engine.config, sort_keys=True))

        class DumpTrainerArgs(pl.Callback):
            """What the Trainer was built with, read back from the Trainer itself."""

            def on_train_start(self, trainer, pl_module):
                if trainer.global_rank != 0:
                    return
                conn = trainer._accelerator_connector
                Path(run_dir, "trainer-args.json").write_text(json.dumps({
                    "accelerator": "cpu" if trainer.accelerator.__class__.__name__ == "CPUAccelerator" else "gpu",
                    "devices": trainer.num_devices,
                    "num_nodes": trainer.num_nodes,
                    "precision": trainer.precision,
                    "max_steps": trainer.max_steps,
                    "max_epochs": trainer.max_epochs,
                    "accumulate_grad_batches": trainer.accumulate_grad_batches,
                    "val_check_interval": trainer.val_check_interval,
                    "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
                    "limit_val_batches": trainer.limit_val_batches,
                    "num_sanity_val_steps": trainer.num_sanity_val_steps,
                    "log_every_n_steps": trainer.log_every_n_steps,
                    "gradient_clip_val": trainer.gradient_clip_val,
                    "use_distributed_sampler": conn.use_distributed_sampler,
                    "enable_checkpointing": trainer.checkpoint_callback is not None,
                    "enable_progress_bar": trainer.progress_bar_callback is not None,
                    "default_root_dir": trainer.default_root_dir,
                }, sort_keys=True))

        class DumpFinalLogits(pl.Callback):
            def on_train_end(self, trainer, pl_module):
                import torch

                if getattr(pl_module, "pipeline", None) is not None:
                    return  # no rank holds the whole model: the pipeline test compares exports instead
                ids = (torch.arange(32) * 7 % 256).unsqueeze(0)  # (1, T)
                pl_module.eval()
                with torch.no_grad():
                    logits = pl_module(ids).logits  # (1, T, vocab); positions given under sequence parallelism
                pl_module.train()
                if trainer.global_rank == 0:  # with what MFU counts of the model as it trained (ZeRO-3: partitioned)
                    torch.save({"input_ids": ids, "logits": logits.detach().cpu(), "shape": dataclasses.asdict(pl_module.shape)},
                               Path(run_dir, "final-logits.pt"))

        return [RequestStop(), DumpEngineConfig(), DumpTrainerArgs(), DumpFinalLogits()]

    return run_task_with(run_dir, setup)


if __name__ == "__main__":
    sys.exit(main())
