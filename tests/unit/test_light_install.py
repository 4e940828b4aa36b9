"""The CLI without the training stack (`pip install lmlaunch`, no `[runtime]` extra): what the
package declares, and the CLI run in a process where torch, Lightning, transformers, DeepSpeed
and tokenizers cannot be found (find_spec says so; importing one fails): the commands that only
plan, validate and describe work; those that need the stack say so, with the extra to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

REPO = Path(__file__).resolve().parents[2]
STACK = ("torch", "lightning", "transformers", "deepspeed", "tokenizers", "tensorboard")

# Run lmlaunch's main with the training stack hidden: a meta path finder refuses it and
# importlib.util.find_spec (what launcher.planning.runtime_stack asks) does not find it.
HIDDEN = r"""
import importlib.abc, importlib.util, json, sys
STACK = tuple(json.loads(sys.argv[1]))
def hidden(name):
    return name.split(".")[0] in STACK
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if hidden(name):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: a CLI-only install)", name=name)
        return None
sys.meta_path.insert(0, Refuse())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if hidden(name) else _find_spec(name, package)
from launcher.cli import main
code = main(sys.argv[2:])
loaded = sorted(m for m in sys.modules if hidden(m))
print("LOADED", json.dumps(loaded))
sys.exit(code)
"""


def _cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {**os.environ, "LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, "-c", HIDDEN, json.dumps(STACK), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    out = proc.stdout + proc.stderr
    assert 'LOADED []' in out, out[-3000:]  # nothing of the stack was imported
    return proc.returncode, out


def test_the_package_declares_the_training_stack_as_an_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    runtime = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["optional-dependencies"]["runtime"]}
    assert not base & {"torch", "lightning", "transformers", "deepspeed"}, base
    assert {"torch", "lightning", "transformers", "deepspeed"} <= runtime, runtime
    assert '.[runtime,dev]' in (REPO / "scripts" / "setup.sh").read_text()  # the repo's own setup has both


def test_without_the_stack_the_cli_plans_and_validates_and_the_stack_commands_say_what_is_missing(tmp_path):
    spec = str(REPO / "jobs" / "tiny-cpu.yaml")
    code, out = _cli(tmp_path, "validate", spec)
    assert code == 0, out
    code, out = _cli(tmp_path, "submit", spec, "--dry-run")
    assert code == 0 and "#SBATCH" in out, out[-3000:]
    code, out = _cli(tmp_path, "schema")
    assert code == 0 and '"properties"' in out, out[-2000:]
    for args, command in ((("run", "--local", spec), "run --local"),
                          (("export", "somerun", "--to", "hf", str(tmp_path / "hf")), "export")):
        code, out = _cli(tmp_path, *args)
        assert code == 2, out
        assert f"`lmlaunch {command}` needs the training stack and torch is not installed in this environment " \
               "(pip install 'lmlaunch[runtime]')" in out, out
    assert not (tmp_path / "hf").exists() and not (tmp_path / "runs").exists()  # nothing made


def test_an_installed_wheel_finds_the_shipped_profiles(monkeypatch, tmp_path):
    """A wheel carries cluster_profiles/ as launcher/cluster_profiles (pyproject's package-dir):
    without a checkout beside the code, the presets are found there."""
    from launcher.spec import profiles

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["launcher.cluster_profiles"] == "cluster_profiles"
    assert "launcher.cluster_profiles" in setuptools["packages"]
    monkeypatch.setattr(profiles, "REPO_PROFILES", tmp_path / "no-checkout")
    monkeypatch.setattr(profiles, "SHIPPED_PROFILES", REPO / "cluster_profiles")
    found = profiles.available_profiles({"LMLAUNCH_HOME": str(tmp_path / "home")})
    assert set(found) >= {"local", "h100-ib", "a100-roce", "aws-p5-efa"}, found
