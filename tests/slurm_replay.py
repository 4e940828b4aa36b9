"""SLURM clients' real answers, recorded once per SLURM version and replayed in unit tests.

`python tests/slurm_replay.py capture DIR` (with PATH/SLURM_CONF pointing at a live cluster,
e.g. after `eval "$(lmlaunch cluster env --slurm 24.11)"`) runs a short scenario on it (a held
job, a running two-node job, the same job cancelled) and, through recorder commands first on
PATH, keeps every answer `lmcore.slurm.client` got: its argv, exit code, stdout and stderr, one
JSON file each, keyed by the scenario's phase and the argv. :func:`replaying` puts replay
commands first on PATH that answer exactly so (a call with an argv never recorded exits 99
saying so). tests/unit/test_slurm_outputs.py reads both versions' recordings through the parsers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import waiting
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

COMMANDS = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo", "srun", "sacctmgr")
PHASE_ENV = "LMLAUNCH_REPLAY_PHASE"


def key(name: str, args: list[str], phase: str) -> str:
    return f"{phase}-{name}-" + hashlib.sha1(json.dumps([name, *args]).encode()).hexdigest()[:12]


_RECORDER = '''#!{python}
import json, os, subprocess, sys
sys.path.insert(0, {tests!r})
from slurm_replay import key
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
p = subprocess.run([{real!r}[name], *args], capture_output=True, text=True)
k = key(name, args, os.environ.get({phase_env!r}, ""))
with open(os.path.join({out!r}, k + ".json"), "w") as f:
    json.dump({{"argv": [name, *args], "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}}, f, indent=1)
sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); sys.exit(p.returncode)
'''

_REPLAYER = '''#!{python}
import json, os, sys
sys.path.insert(0, {tests!r})
from slurm_replay import key
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
path = os.path.join({src!r}, key(name, args, os.environ.get({phase_env!r}, "")) + ".json")
if not os.path.exists(path):
    sys.stderr.write("slurm_replay: nothing recorded for " + json.dumps([name, *args]) + "\\n"); sys.exit(99)
rec = json.load(open(path))
sys.stdout.write(rec["stdout"]); sys.stderr.write(rec["stderr"]); sys.exit(rec["rc"])
'''


def _write_commands(bindir: Path, template: str, **fields: object) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = bindir / name
        path.write_text(template.format(python=sys.executable, tests=str(Path(__file__).parent),
                                        phase_env=PHASE_ENV, **fields))
        path.chmod(0o755)


@contextlib.contextmanager
def replaying(src: Path) -> Iterator[None]:
    """SLURM commands answer from ``src``'s recordings inside the block."""
    with tempfile.TemporaryDirectory() as tmp:
        _write_commands(Path(tmp), _REPLAYER, src=str(src))
        old = os.environ.get("PATH", "")
        os.environ["PATH"] = f"{tmp}:{old}"
        try:
            yield
        finally:
            os.environ["PATH"] = old


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    os.environ[PHASE_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(PHASE_ENV, None)


def _sbatch(*args: str) -> str:
    return subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True,
                          timeout=HANG_S).stdout.strip().split(";")[0]


def capture(out: Path) -> None:
    """Run the scenario on the cluster the environment names, recording into ``out``."""
    from lmcore.slurm import client as slurm

    real = {n: shutil.which(n) for n in COMMANDS}
    missing = [n for n, p in real.items() if p is None]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} on PATH")
    out.mkdir(parents=True, exist_ok=True)
    held = _sbatch("-J", "replay-held", "-p", "low", "-N", "1", "--hold", "-o", "/dev/null", "--wrap", "sleep 60")
    het = _sbatch("-J", "replay-het", "-p", "low", "-N", "1", "--hold", "-o", "/dev/null", ":", "-p", "low", "-N", "1",
                  "--wrap", "sleep 60")  # a heterogeneous job (the evaluator alongside): two components
    running = _sbatch("-J", "replay-running", "-p", "low", "-N", "2", "--requeue", "-o", "/dev/null",
                      "--wrap", "srun sleep 120")
    waiting.until(lambda: subprocess.run(["squeue", "-h", "-j", running, "-o", "%T"], capture_output=True,
                                         text=True).stdout.strip() == "RUNNING",
                  progress=waiting.queue(), what=f"job {running} started")
    time.sleep(2)
    with tempfile.TemporaryDirectory() as tmp:
        _write_commands(Path(tmp), _RECORDER, real=real, out=str(out))
        path = os.environ["PATH"]
        os.environ["PATH"] = f"{tmp}:{path}"
        try:
            with phase("live"):
                slurm.ping(), slurm.nodes(), slurm.partitions(), slurm.partition_configs(), slurm.node_configs()
                slurm.config(), slurm.squeue([held, running]), slurm.show_job(running), slurm.show_job("999999")
                slurm.sacct([held, running], duplicates=True), slurm.squeue(["999999"])
                slurm.squeue([het]), slurm.squeue([het, f"{het}+1"]), slurm.sacct([het], duplicates=True)
            os.environ["PATH"] = path
            slurm.cancel([running, held, het])
            while slurm.is_active(subprocess.run(["squeue", "-h", "-j", running, "-o", "%T"], capture_output=True,
                                                 text=True).stdout.strip() or "CANCELLED"):
                time.sleep(0.5)
            time.sleep(3)  # accounting catches up
            os.environ["PATH"] = f"{tmp}:{path}"
            with phase("ended"):
                slurm.squeue([running]), slurm.sacct([running], duplicates=True), slurm.show_job(running)
        finally:
            os.environ["PATH"] = path
    version = subprocess.run(["sbatch", "--version"], capture_output=True, text=True).stdout.split()[-1]
    (out / "scenario.json").write_text(json.dumps({"version": version, "held": held, "running": running, "het": het},
                                                    indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "capture":
        raise SystemExit("usage: python tests/slurm_replay.py capture DIR")
    capture(Path(sys.argv[2]))
