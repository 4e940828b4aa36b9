"""lmlaunch's own directory on the login node: ``$LMLAUNCH_HOME``, default ``~/.lmlaunch``. It
holds the registry, the caches, the excluded-node records and the user's cluster profiles
(``profiles/``, where `lmlaunch profile init` writes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def lmlaunch_home(environ: Mapping[str, str] | None = None) -> Path:
    """``environ``'s LMLAUNCH_HOME; where the command's environment does not name one (a partial
    environment: a test's, a forwarded command's), this process's; else ``~/.lmlaunch``."""
    env = os.environ if environ is None else environ
    named = env.get("LMLAUNCH_HOME") or os.environ.get("LMLAUNCH_HOME")
    return Path(os.path.expanduser(named or "~/.lmlaunch")).absolute()


def user_profiles_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's own cluster profiles: searched after ``LMLAUNCH_PROFILES_DIR`` and before the
    shipped ones."""
    return lmlaunch_home(environ) / "profiles"
