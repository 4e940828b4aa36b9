"""lmlaunch's own directory on the login node: ``$LMLAUNCH_HOME``, default ``~/.lmlaunch``. It
holds the registry, the caches, the excluded-node records and the user's cluster profiles
(``profiles/``, where `lmlaunch profile init` writes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def lmlaunch_home(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(os.path.expanduser(env.get("LMLAUNCH_HOME") or "~/.lmlaunch")).absolute()


def user_profiles_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's own cluster profiles: searched after ``LMLAUNCH_PROFILES_DIR`` and before the
    shipped ones."""
    return lmlaunch_home(environ) / "profiles"
