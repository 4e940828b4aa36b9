"""Rank processes for the tests that start a helper script as each rank themselves (instead of
through ``lmtrain.local.launch.launch``): forked from this test process's zygote (tests/conftest.py), as a
local launch's ranks are, so that each rank does not import torch, Lightning and transformers
again (~5 CPU-s); a plain process where there is no zygote (LMTRAIN_ZYGOTE=off) or it cannot
fork this one (lmtrain.local.zygote says when). Either way the handle is used like a subprocess.Popen:
``pid``, ``poll``, ``wait(timeout)``, ``send_signal``, ``kill``, ``returncode`` (negative for a
signal)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from lmtrain.local.launch import start_rank
from lmtrain.local.zygote import Zygote


def start(cmd: Sequence[str], env: Mapping[str, str], out: BinaryIO | None = None):
    """Start ``cmd`` with ``env`` in the current directory, its stdout and stderr into ``out``
    (a file opened for writing in binary mode; None: discarded)."""
    sink = out if out is not None else open(os.devnull, "wb")
    try:
        return start_rank(Zygote.shared(), list(cmd), dict(env), os.getcwd(), sink)
    finally:
        if out is None:
            sink.close()
