"""Test helper run as each local rank: the real lmtrain entry, plus a callback that, after the
optimizer step of step 2, saves the same training state twice: through lmtrain's background
staging (lmtrain.checkpoint.async_sharded._stage_zero, then its write) into RUN_DIR/cmp-staged,
and through DeepSpeed's own save (TorchCheckpointEngine) into RUN_DIR/cmp-deepspeed. Rank 0 also
writes RUN_DIR/cmp-facts.json: how many module-state entries the staging saved as placeholders
(gathered persistent parameters) and whether the gathered ones were still gathered after it.

usage: python _compare_zero_saves.py RUN_DIR
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from _extra_callbacks import run_task_with


def main() -> int:
    run_dir = sys.argv[1]

    class SaveTwice(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != 2:
                return
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            from lmtrain.checkpoint import async_sharded

            engine = trainer.strategy.deepspeed_engine
            gathered = [p for p in engine.module.parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]
            manager = type("Manager", (), {"stagers": {}})()
            staged = Path(run_dir, "cmp-staged")
            write = async_sharded._stage_zero(manager, trainer, staged)
            still = all(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in gathered)
            write()
            trainer.save_checkpoint(str(Path(run_dir, "cmp-deepspeed")))
            if trainer.global_rank == 0:
                Path(run_dir, "cmp-facts.json").write_text(json.dumps({
                    "gathered": len(gathered), "still_gathered": still}))

    return run_task_with(run_dir, lambda _: [SaveTwice()])


if __name__ == "__main__":
    sys.exit(main())
