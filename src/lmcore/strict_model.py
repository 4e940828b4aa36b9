"""The base of every schema a user writes (job spec, cluster profile, their sections)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """The base of every schema a user writes (job spec, cluster profile).

    strict: `nodes: yes` or `nodes: "4"` is an error, not 1 or 4 (YAML already types scalars);
    unknown keys are errors; every field's docstring is its documentation."""

    # allow_inf_nan=False: `.inf`, `.nan` or `1e400` (read as inf) is an error, never a value.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True, allow_inf_nan=False
    )
