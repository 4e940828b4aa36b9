"""What an attempt ran on, recorded by rank 0 at its start (``logs/attempt-<N>/environment.json``):
the nodes, the package versions, CUDA/NCCL where present, the plan's hash and the environment the
task saw, secrets by name only. `lmlaunch diff` compares two runs' records."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lmcore.atomic import write_private
from lmcore.run.rundir import RunLayout

PACKAGES = ("torch", "lightning", "transformers", "deepspeed", "numpy", "tokenizers", "submitit", "lmlaunch")
SECRET_WORDS = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE|CREDENTIAL|_KEY$|^KEY$)", re.I)
REDACTED = "<secret: value not recorded>"


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def visible_environment(environ: Mapping[str, str], secret_names: Iterable[str]) -> dict[str, str]:
    """The task's environment with every secret by name only: the plan's passthrough names and
    any name that looks like a credential."""
    secrets = set(secret_names)
    return {k: (REDACTED if k in secrets or SECRET_WORDS.search(k) else v) for k, v in sorted(environ.items())}


def accelerator_versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "nccl": None}
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            out["nccl"] = None
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def code_in_use(run_dir: Path) -> dict[str, Any]:
    """Where this process imported lmtrain and the kernel (lmcore) from, and whether that is the run's snapshot."""
    import lmcore
    import lmtrain

    snapshot = RunLayout.of(run_dir).code.resolve()
    paths = {"lmtrain": str(Path(lmtrain.__file__).resolve().parent),
             "lmcore": str(Path(lmcore.__file__).resolve().parent)}
    try:
        digest = json.loads((snapshot / "manifest.json").read_text()).get("digest")
    except (OSError, ValueError):
        digest = None
    return {**paths, "snapshot_digest": digest,
            "from_snapshot": all(Path(p).is_relative_to(snapshot) for p in paths.values())}


def container_in_use(plan: Any, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The container this task runs in, as the plan names it and as the batch step found its image
    on the host (``LMLAUNCH_IMAGE_ID``: a podman image id, or a file's sha256)."""
    box = getattr(plan, "container", None)
    if not box:
        return None
    return {"runtime": box.get("runtime"), "image": box.get("image"),
            "image_id": environ.get("LMLAUNCH_IMAGE_ID") or "unknown"}


def record_environment(plan: Any, env: Any, attempt: int) -> Path:
    """Rank 0: write this attempt's environment record; returns its path."""
    layout = RunLayout.of_plan(plan)
    plan_json = Path(plan.paths.plan_json)
    record = {
        "attempt": attempt,
        "time": time.time(),
        "job_id": env.job_id,
        "nodes": list(env.nodes),
        "world_size": env.world_size,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        **accelerator_versions(),
        "plan_sha256": hashlib.sha256(plan_json.read_bytes()).hexdigest() if plan_json.exists() else None,
        "code": code_in_use(layout.run_dir),
        "container": container_in_use(plan, os.environ),
        "env": visible_environment(os.environ, plan.passthrough),
    }
    path = layout.environment(attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path
