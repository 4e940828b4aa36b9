"""DeepSpeed's JIT-built ops (lmtrain.distributed.jit_ops): one build folder per Python environment, and
doctor says when a ZeRO job's ranks would compile at run time."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from launcher.doctor import checks as doctor
from launcher.doctor.ops import jit_ops as doctor_jit_ops
from launcher.planning.resolve import resolve
from lmtrain.distributed import jit_ops

ENV = {"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/home/u", "USER": "u"}


def test_each_environment_builds_into_a_folder_of_its_own_unless_the_user_named_one():
    home = {"HOME": "/home/u"}
    one = jit_ops.extensions_dir(home, prefix="/work/a/.venv")
    assert one.parent == jit_ops.Path("/home/u/.cache/torch_extensions") and one.name.startswith("lmlaunch-")
    assert jit_ops.extensions_dir(home, prefix="/work/a/.venv") == one  # stable
    assert jit_ops.extensions_dir(home, prefix="/work/b/.venv") != one  # another venv (or another path to it)
    assert jit_ops.extensions_dir({**home, "XDG_CACHE_HOME": "/c"}, prefix="/work/a/.venv").parent == \
        jit_ops.Path("/c/torch_extensions")
    assert jit_ops.extensions_dir({**home, "TORCH_EXTENSIONS_DIR": "/mine"}) == jit_ops.Path("/mine")


def test_check_says_where_and_what_is_built(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    said = json.loads(subprocess.run([sys.executable, "-m", "lmtrain.distributed.jit_ops", "--check", "--op", "shm", "--op",
                                      "cpu_adam"], capture_output=True, text=True, env=env, check=True).stdout)
    assert said == {"dir": str(tmp_path), "built": {"shm": False, "cpu_adam": False}, "not_buildable": []}
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    assert jit_ops.built("shm", tmp_path) and not jit_ops.built("cpu_adam", tmp_path)


@pytest.mark.parametrize("spec, cluster, overrides, ops", [
    ("tiny-cpu", "local", ["trainer.strategy=deepspeed", "trainer.zero_stage=2"], ["shm"]),  # CPU: the collective
    ("llama-1b-zero2", "h100-ib", ["trainer.offload_optimizer=true"], ["cpu_adam"]),  # GPU: the offloaded Adam
    ("llama-1b-zero2", "h100-ib", [], None),  # GPU without offload: torch's AdamW, nothing compiled
    ("tiny-cpu", "local", [], None),  # DDP compiles nothing
])
def test_doctor_warns_when_a_zero_job_would_compile_deepspeeds_ops_at_run_time(repo, tmp_path, monkeypatch,
                                                                                spec, cluster, overrides, ops):
    plan = resolve(str(repo / "jobs" / f"{spec}.yaml"), overrides, cluster=cluster, environ=ENV).plan
    plan = dataclasses.replace(plan, python=sys.executable, setup=())  # the tasks' interpreter: this one
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    offload = "trainer.offload_optimizer=true" in overrides
    check = doctor_jit_ops(plan, offload)
    if ops is None:
        assert check is None
        return
    assert check.status == doctor.WARN and f"{', '.join(ops)} op(s) are not built in {tmp_path}" in check.message
    assert "-m lmtrain.distributed.jit_ops --build" in check.message
    for op in ops:
        name = jit_ops.OPS[op][1]
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"\x7fELF")
    check = doctor_jit_ops(plan, offload)
    assert check.status == doctor.OK and str(tmp_path) in check.message
