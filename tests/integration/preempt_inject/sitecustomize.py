"""Test-only fault injection for the preemption integration tests, loaded in the SLURM tasks
through ``env.vars.PYTHONPATH`` (Python imports ``sitecustomize`` at start-up). It changes no
numbers; it only slows steps down or SIGKILLs a task at a named point of a checkpoint write.

- ``LMTRAIN_TEST_STEP_SLEEP=S``: sleep S seconds after every optimizer step (slow runs for the
  time-limit tests without burning CPU).
- ``LMTRAIN_TEST_KILL_PLAN=FILE``: JSON ``{"<attempt>": {"step": S, "points": {"<rank>": POINT}}}``;
  in that attempt (counted from the run's ledger) rank R SIGKILLs itself at POINT of the save of
  step S. POINT: ``before_rank_file``, ``after_rank_file``, ``before_meta``, ``before_complete``
  (after the rename to step-S), ``before_latest``, ``before_prune``.

The patches are applied when lmtrain's modules are imported (a meta path hook), so processes
that never import lmtrain are untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import time

_STEP_SLEEP = float(os.environ.get("LMTRAIN_TEST_STEP_SLEEP") or 0)
_KILL_PLAN = os.environ.get("LMTRAIN_TEST_KILL_PLAN")
_state = {"step": None}


def _attempt() -> int:
    ledger = os.path.join(os.environ.get("LMLAUNCH_RUN_DIR", ""), "attempts.jsonl")
    n = 0
    try:
        with open(ledger) as f:
            for line in f:
                try:
                    n += json.loads(line).get("event") == "start"
                except ValueError:
                    pass
    except OSError:
        pass
    return n


def _rank() -> str:
    return os.environ.get("SLURM_PROCID") or os.environ.get("RANK") or "0"


def _maybe_kill(point: str) -> None:
    if not _KILL_PLAN or _state["step"] is None:
        return
    try:
        with open(_KILL_PLAN) as f:
            plan = json.load(f)
    except (OSError, ValueError):
        return
    entry = plan.get(str(_attempt()))
    if entry and int(entry["step"]) == _state["step"] and entry["points"].get(_rank()) == point:
        sys.stderr.write(f"[inject] rank {_rank()}: SIGKILL at {point} of the save of step {_state['step']}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _patch_checkpoint(mod) -> None:
    save, torch_save_atomic, write_text_atomic, prune = (
        mod.CheckpointManager.save, mod.torch_save_atomic, mod.write_text_atomic, mod.CheckpointManager.prune)

    def save_(self, trainer, *, step, rank_state):
        _state["step"] = step
        try:
            return save(self, trainer, step=step, rank_state=rank_state)
        finally:
            _state["step"] = None

    def torch_save_atomic_(obj, path):
        rank_file = os.path.basename(str(path)).startswith("rank-")
        if rank_file:
            _maybe_kill("before_rank_file")
        torch_save_atomic(obj, path)
        if rank_file:
            _maybe_kill("after_rank_file")

    def write_text_atomic_(path, text):
        name = os.path.basename(str(path))
        _maybe_kill({"meta.json": "before_meta", "COMPLETE": "before_complete", "latest": "before_latest"}.get(name, ""))
        return write_text_atomic(path, text)

    def prune_(self):
        _maybe_kill("before_prune")
        return prune(self)

    mod.CheckpointManager.save, mod.CheckpointManager.prune = save_, prune_
    mod.torch_save_atomic, mod.write_text_atomic = torch_save_atomic_, write_text_atomic_


def _patch_callbacks(mod) -> None:
    original = mod.CheckpointCallback.on_train_batch_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(_STEP_SLEEP)
        return original(self, trainer, pl_module, outputs, batch, batch_idx)

    mod.CheckpointCallback.on_train_batch_end = on_train_batch_end


_PATCHES = {}
if _KILL_PLAN:
    _PATCHES["lmtrain.checkpoint"] = _patch_checkpoint
if _STEP_SLEEP > 0:
    _PATCHES["lmtrain.callbacks"] = _patch_callbacks


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, patch = spec.loader, _PATCHES[name]

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _Finder())
