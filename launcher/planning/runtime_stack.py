"""The CLI without the training stack. ``pip install lmlaunch`` is the CLI alone (a workstation,
a login node that only submits and watches); ``pip install 'lmlaunch[runtime]'`` adds torch,
Lightning, transformers and DeepSpeed, which the allocation runs and a few commands use here
(``run --local``, ``export``, ``data``, the model check of ``doctor``). Such a command says what
is missing instead of failing with a traceback; nothing is imported to find out."""

from __future__ import annotations

import importlib.util

from lmcore.errors import UserError

TRAINING_STACK = ("torch", "lightning", "transformers")
INSTALL = "pip install 'lmlaunch[runtime]'"


def missing(packages: tuple[str, ...] = TRAINING_STACK) -> str | None:
    """The first of ``packages`` that is not installed here (found without importing it)."""
    for name in packages:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def require(command: str, packages: tuple[str, ...] = TRAINING_STACK) -> None:
    """UserError naming what is missing when ``command`` cannot run in this install."""
    name = missing(packages)
    if name is not None:
        raise UserError(
            f"`lmlaunch {command}` needs the training stack and {name} is not installed in this "
            f"environment ({INSTALL}); the CLI alone validates, submits and watches runs"
        )
