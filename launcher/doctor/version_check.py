"""doctor's SLURM version check (pure: the facts come in): the live controller's release against
the profile's record of it (`profile init` writes ``slurm_version``) and against the releases
lmlaunch is tested on (lmcore.slurm.versions)."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.spec.profiles import Profile
from lmcore.slurm import versions


def version_problems(profile: Profile, config: Mapping[str, str]) -> list[str]:
    live = config.get("SLURM_VERSION", "")
    problems = []
    if profile.slurm_version and live and versions.release(profile.slurm_version) != versions.release(live):
        problems.append(f"profile '{profile.name}' was read off SLURM {profile.slurm_version}, the cluster now runs "
                        f"{live} (`lmlaunch profile init` reads it again)")
    if profile.expedited_requeue and "enable_expedited_requeue" not in config.get("SlurmctldParameters", ""):
        problems.append(f"profile '{profile.name}' says expedited_requeue, but the cluster's SlurmctldParameters lack "
                        "enable_expedited_requeue: requeued jobs wait requeue_delay as any other")
    note = versions.untested_note(live)
    if note:
        problems.append(note)
    return problems
