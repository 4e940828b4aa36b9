"""The base of every schema a user writes (job spec, cluster profile, their sections)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

# In a training task (an srun task of an lmlaunch job: the batch script exports LMLAUNCH_RUN_DIR) nothing
# reads the fields' documentation, and pydantic reads it from the source files (inspect: a stat and an
# open of each model's module, ~180 filesystem operations per process on the run's code snapshot: at
# 16,384 ranks, 3 million at every start; docs/scale.md). Everywhere else (the CLI, `lmlaunch schema`,
# the tests) every field's docstring is its documentation.
_IN_A_TASK = bool(os.environ.get("SLURM_PROCID") and os.environ.get("LMLAUNCH_RUN_DIR"))


class StrictModel(BaseModel):
    """The base of every schema a user writes (job spec, cluster profile).

    strict: `nodes: yes` or `nodes: "4"` is an error, not 1 or 4 (YAML already types scalars);
    unknown keys are errors; every field's docstring is its documentation."""

    # allow_inf_nan=False: `.inf`, `.nan` or `1e400` (read as inf) is an error, never a value.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=not _IN_A_TASK, frozen=True, strict=True, allow_inf_nan=False
    )
