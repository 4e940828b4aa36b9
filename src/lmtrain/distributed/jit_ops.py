"""DeepSpeed's JIT-built ops: one build directory per Python environment, built ahead of a job.

DeepSpeed installed without its ops (``DS_BUILD_OPS=0``, as it must be where no CUDA toolkit is)
compiles an op the first time a process needs it: the CPU shared-memory collective in every ZeRO
rank of a CPU job, DeepSpeed's CPU Adam under ``offload_optimizer``. The build goes to torch's
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``: one folder for every environment
of the user. Two environments, or one reached through two paths (other include paths, so another
build hash), rebuild each other's op there, each time under one file lock that every rank of
every job waits on (seen here: a ZeRO run past 10 minutes at "initializing deepspeed
distributed"); on a real cluster a shared home makes every node wait on that lock.

So lmtrain gives each environment (its ``sys.prefix`` as the process sees it, torch's and
Python's versions) a build folder of its own, unless ``TORCH_EXTENSIONS_DIR`` is set, and builds
the ops ahead: ``scripts/setup.sh`` runs ``python -m lmtrain.distributed.jit_ops --build``, and ``lmlaunch
doctor`` says when a job's ranks would compile at run time (``--check``).

    python -m lmtrain.distributed.jit_ops --check [--op shm --op cpu_adam]   # JSON: the folder and each op's build
    python -m lmtrain.distributed.jit_ops --build [--op ...]                  # build them now (~1 CPU-min each)

No torch import at import time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

# lmtrain's name of an op -> (DeepSpeed's builder, the extension's name: the build's folder)
OPS = {
    "shm": ("ShareMemCommBuilder", "deepspeed_shm_comm"),
    "cpu_adam": ("CPUAdamBuilder", "cpu_adam"),
}


def extensions_dir(environ: dict[str, str] | None = None, prefix: str | None = None) -> Path:
    """Where this environment's JIT ops are built: ``TORCH_EXTENSIONS_DIR`` when set, else
    ``~/.cache/torch_extensions/lmlaunch-<key>`` with the key of ``sys.prefix``, torch and Python."""
    env = os.environ if environ is None else environ
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    key = "\0".join([prefix or sys.prefix, torch_version, sys.version.split()[0]])
    cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
    return cache / "torch_extensions" / f"lmlaunch-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def use_own_extensions_dir() -> Path:
    """Point this process's JIT builds at :func:`extensions_dir` (before DeepSpeed builds one)."""
    where = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(where)
    return where


def built(op: str, where: Path | None = None) -> bool:
    """Whether ``op``'s library is in the build folder (its sources' hash is torch's to judge
    when it loads; a library there from the same environment is current unless DeepSpeed changed)."""
    name = OPS[op][1]
    folder = (where or extensions_dir()) / name
    return (folder / f"{name}.so").is_file()


def build(op: str) -> bool:
    """Build ``op`` into this environment's folder now; False where this DeepSpeed has no such op
    for its accelerator."""
    use_own_extensions_dir()
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(OPS[op][0])
    if builder is None or not builder.is_compatible(verbose=False):
        return False
    builder.load()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmtrain.distributed.jit_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="say where the ops are built and which are (JSON)")
    ap.add_argument("--build", action="store_true", help="build the ops now")
    ap.add_argument("--op", action="append", choices=sorted(OPS), help="the op (repeat; default: shm)")
    args = ap.parse_args(argv)
    ops = args.op or ["shm"]
    failed = []
    if args.build:
        for op in ops:
            if not build(op):
                failed.append(op)
    where = extensions_dir()
    print(json.dumps({"dir": str(where), "built": {op: built(op, where) for op in ops}, "not_buildable": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
