"""The plan's record of the run directory's paths (lmcore.job.plan.RunPaths), and where the checkpoints
are kept: the spec's directory, else the run directory's; a bucket too (``checkpoint.dir: s3://...``)
with the profile's credentials file."""

from __future__ import annotations

from pathlib import PurePosixPath

from launcher.spec.profiles import Profile
from lmcore.job.plan import RunPaths
from lmcore.job.spec import JobSpec
from lmcore.run import rundir


def run_paths(spec: JobSpec, profile: Profile, runs_root: str, *, uses_deepspeed: bool, problems: list[str]) -> RunPaths:
    """As :class:`lmcore.run.rundir.RunLayout` (their one speller) places them; a bucket without the
    profile's credentials file is one of ``problems``."""
    layout = rundir.RunLayout.of(str(PurePosixPath(runs_root) / spec.name))
    store = spec.checkpoint.store
    if store and not profile.object_store_credentials:
        problems.append(f"checkpoint.dir: {store} needs S3 credentials, and profile '{profile.name}' names none: "
                        "set object_store_credentials in it to the credentials file (JSON of endpoint, access_key, "
                        "secret_key; mode 600)")
    return RunPaths(
        run_dir=str(layout.run_dir),
        submitit_dir=str(layout.submitit),
        logs_dir=str(layout.logs),
        checkpoint_dir=str(spec.checkpoint.local_dir or layout.default_checkpoints),
        heartbeat=str(layout.heartbeat),
        ledger=str(layout.ledger),
        plan_json=str(layout.plan),
        spec_yaml=str(layout.spec_yaml),
        deepspeed_json=str(layout.deepspeed_json) if uses_deepspeed else None,
        checkpoint_store=store,
        checkpoint_store_credentials=profile.object_store_credentials if store else None,
    )
