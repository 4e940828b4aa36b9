"""Doctor's check of DeepSpeed's JIT-built ops for the tasks' interpreter (lmtrain.distributed.jit_ops), run on
this machine after the profile's setup lines, as doctor's runtime check is (the nodes see the same
filesystem): a ZeRO job whose ops are not built compiles them in every rank of its first attempt."""

from __future__ import annotations

import json
import os
import subprocess

from launcher.doctor.checks import OK, RUNTIME_IMPORT_TIMEOUT_S, WARN, Check
from lmcore.job.plan import LaunchPlan


def jit_ops(plan: LaunchPlan, offload_optimizer: bool) -> Check | None:
    """Whether the DeepSpeed ops a ZeRO job compiles on first use are built for the tasks'
    interpreter (lmtrain.distributed.jit_ops: one build folder per environment): the CPU shared-memory
    collective on CPU jobs, the CPU Adam under offload_optimizer. None: the job needs none."""
    zero = plan.parallelism.zero
    ops = (["shm"] if zero and plan.trainer.accelerator == "cpu" else []) + (["cpu_adam"] if zero and offload_optimizer else [])
    if not ops:
        return None
    args = " ".join(f"--op {op}" for op in ops)
    command = f"{plan.python} -m lmtrain.distributed.jit_ops --check {args}"
    script = "\n".join([*plan.setup, command])
    env = {**os.environ, **{k: v for k, v in plan.env.items() if k in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")}}
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                              timeout=RUNTIME_IMPORT_TIMEOUT_S, check=False)
        said = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return Check("deepspeed ops", WARN, f"`{command}` gave no answer: could not tell whether DeepSpeed's ops are built")
    missing = [op for op, done in said["built"].items() if not done]
    if missing:
        return Check("deepspeed ops", WARN,
                     f"DeepSpeed's {', '.join(missing)} op(s) are not built in {said['dir']}: each rank of the first "
                     f"attempt compiles them (about a CPU-minute each, every node waiting on one lock where the home "
                     f"is shared); build them ahead: {command.replace('--check', '--build')}", said)
    return Check("deepspeed ops", OK, f"DeepSpeed's {', '.join(ops)} op(s) built in {said['dir']}", said)
