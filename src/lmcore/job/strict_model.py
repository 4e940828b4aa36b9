"""The base of every schema a user writes (job spec, cluster profile, their sections)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

# In a training task nothing reads the fields' documentation, and pydantic reads it from the source
# files (inspect: a stat and an open of each model's module, ~180 filesystem operations per process on
# the run's code snapshot: at 16,384 ranks, 3 million at every start; docs/scale.md). On Python < 3.13
# it also walks the importing frames with inspect.getmodule, which for a module imported from the
# snapshot's zip scans every loaded module: ~1.8 CPU-s a rank once torch, Lightning and transformers
# are loaded (a rank forked from the local launcher's zygote), 0.2 s from a source tree.
# A task: an srun task of an lmlaunch job (the batch script exports LMLAUNCH_RUN_DIR) or a rank of a
# local launch (lmtrain.local.launch sets LMTRAIN_LAUNCHER=local). Everywhere else (the CLI,
# `lmlaunch schema`, the tests' own process) every field's docstring is its documentation.
_IN_A_TASK = bool(os.environ.get("SLURM_PROCID") and os.environ.get("LMLAUNCH_RUN_DIR")) or \
    os.environ.get("LMTRAIN_LAUNCHER") == "local"


class StrictModel(BaseModel):
    """The base of every schema a user writes (job spec, cluster profile).

    strict: `nodes: yes` or `nodes: "4"` is an error, not 1 or 4 (YAML already types scalars);
    unknown keys are errors; every field's docstring is its documentation."""

    # allow_inf_nan=False: `.inf`, `.nan` or `1e400` (read as inf) is an error, never a value.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=not _IN_A_TASK, frozen=True, strict=True, allow_inf_nan=False
    )
