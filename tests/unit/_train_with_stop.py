"""Test helper run as each local rank: the real lmtrain entry, plus a callback that asks the
run to stop at a given optimizer step (as a preemption signal handler would), so that the
stop -> collective agreement -> checkpoint -> exit path runs for real.

usage: python _train_with_stop.py RUN_DIR STOP_AT_STEP   (STOP_AT_STEP 0: never)

Rank 0 also writes the config the DeepSpeed engine was initialised with (``engine.config``) to
``RUN_DIR/engine-deepspeed.json`` when the strategy is DeepSpeed, and, when training ends, the
trained model's logits on a fixed input (every rank takes part in the forward: ZeRO-3 and FSDP
gather their shards) to ``RUN_DIR/final-logits.pt``.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl

from lmtrain.entry import Hooks, run_task


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

        class DumpFinalLogits(pl.Callback):
            def on_train_end(self, trainer, pl_module):
                import torch

                ids = (torch.arange(32) * 7 % 256).unsqueeze(0)  # (1, T)
                pl_module.eval()
                with torch.no_grad():
                    logits = pl_module.model(input_ids=ids, use_cache=False).logits  # (1, T, vocab)
                pl_module.train()
                if trainer.global_rank == 0:
                    torch.save({"input_ids": ids, "logits": logits.detach().cpu()}, Path(run_dir, "final-logits.pt"))

        return [RequestStop(), DumpEngineConfig(), DumpFinalLogits()]

    return run_task(run_dir, hooks=Hooks(setup=setup))


if __name__ == "__main__":
    sys.exit(main())
