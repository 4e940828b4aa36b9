"""Hostile strings in names, env values and paths never change what the job script does.

Each string is either rejected at validation with a clear message, or rendered so that:
- the #SBATCH directives SLURM reads (parsed back with SLURM's own quoting rules) are
  exactly the planned ones, and
- running the script's setup in a sandboxed bash, with the srun line replaced by a dump of
  the environment, gives every planned variable its exact value and creates no canary file.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.cli import main
from launcher.context import Context
from launcher.planning.resolve import resolve
from launcher.submit.script import render_script
from lmcore.job.plan import LaunchPlan
from tests.unit.malformed_cases import BASE

HOSTILE = [
    "with space",
    "it's \"quoted\"",
    "a'; echo foo",
    "$(touch canary)",
    "`touch canary`",
    "x\n#SBATCH --partition=high",
    "back\\slash",
    "$HOME ${PATH}",
    "semi;colon | pipe & amp > redirect",
    "*glob?[x]",
    "-dash-first",
    "#hash",
]
SLURM_UNSAFE = re.compile(r"[%\\\x00-\x1f]")


def slurm_directives(script: str) -> list[str]:
    """The options sbatch reads from #SBATCH lines, unquoted the way sbatch does it.

    sbatch stops at the first line that is neither blank nor a comment; in a directive,
    single and double quotes group, a backslash escapes the next character and an unquoted
    '#' ends the line (slurm src/sbatch/opt.c, _get_argument).
    """
    options = []
    for line in script.split("\n")[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            continue
        rest, i, quote, escape, arg = line[len("#SBATCH"):], 0, "", False, ""
        args = []
        while i <= len(rest):
            c = rest[i] if i < len(rest) else None
            i += 1
            if c is None or (not quote and not escape and c.isspace()):
                if arg:
                    args.append(arg)
                arg = ""
                if c is None:
                    break
                continue
            if escape:
                arg, escape = arg + c, False
            elif c == "\\":
                escape = True
            elif quote:
                if c == quote:
                    quote = ""
                else:
                    arg += c
            elif c in "'\"":
                quote = c
            elif c == "#":
                break
            else:
                arg += c
        options.extend(args)
    return options


def planned_directives(plan: LaunchPlan) -> list[str]:
    s = plan.slurm
    opts = {
        "chdir": plan.paths.run_dir,  # the tasks start in the run directory (its code snapshot first)
        "cpus-per-task": str(s.cpus_per_task),
        "error": s.error,
        "job-name": s.job_name,
        "nodes": str(s.nodes),
        "ntasks-per-node": str(s.ntasks_per_node),
        "open-mode": s.open_mode,
        "output": s.output,
        "partition": s.partition,
        "signal": s.signal,
        "time": str(s.time_minutes),
    }
    flags = ["--requeue"] + (["--exclusive"] if s.exclusive else [])
    return sorted([f"--{k}={v}" for k, v in opts.items()] + flags)


def write_spec(tmp_path: Path, text: str) -> Path:
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    return spec


def plan_for(spec: Path, environ: dict[str, str]) -> LaunchPlan:
    return resolve(str(spec), [], None, environ, python=sys.executable).plan


def run_setup_in_sandbox(script: str, cwd: Path) -> dict[str, str]:
    """Run the script with the srun line replaced by an environment dump; return the env."""
    lines = script.split("\n")
    srun = [i for i, line in enumerate(lines) if line.startswith("srun ")]
    assert len(srun) == 1
    dump = f"{shlex.quote(sys.executable)} -c 'import json, os; print(json.dumps(dict(os.environ)))'"
    lines[srun[0]] = dump
    proc = subprocess.run(
        ["bash", "-c", "\n".join(lines)],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return json.loads(proc.stdout)


def env_spec(value: str) -> str:
    return BASE + "env:\n  vars:\n    HOSTILE: " + json.dumps(value) + "\n"


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_env_value_reaches_tasks_unchanged_and_runs_nothing(value, tmp_path):
    spec = write_spec(tmp_path, env_spec(value))
    plan = plan_for(spec, {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")})
    script = render_script(plan)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert sorted(slurm_directives(script)) == planned_directives(plan)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    env = run_setup_in_sandbox(script, sandbox)
    assert env["HOSTILE"] == value
    for name, planned in plan.env.items():
        assert env[name] == planned
    assert list(sandbox.iterdir()) == []  # no canary


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_run_name_is_rejected_at_validation(value, tmp_path):
    spec = write_spec(tmp_path, BASE.replace("name: t", "name: " + json.dumps(value)))
    out, err = io.StringIO(), io.StringIO()
    ctx = Context(stdout=out, stderr=err, environ={"LMLAUNCH_RUNS_ROOT": "/runs"})
    assert main(["validate", str(spec)], ctx) == 4
    assert f"name (line 1): {value!r} is not a valid run name" in err.getvalue()


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_data_and_checkpoint_paths_stay_out_of_the_script(value, tmp_path):
    benign = plan_for(write_spec(tmp_path, BASE), {"LMLAUNCH_RUNS_ROOT": "/runs"})
    text = BASE.replace("  path: /data/tiny", "  path: " + json.dumps("/data/" + value))
    text += "checkpoint:\n  dir: " + json.dumps("/ckpt/" + value) + "\n"
    if SLURM_UNSAFE.search(value) and "\\" not in value:  # a line break: no path holds one
        out, err = io.StringIO(), io.StringIO()
        ctx = Context(stdout=out, stderr=err, environ={"LMLAUNCH_RUNS_ROOT": "/runs"})
        assert main(["validate", str(write_spec(tmp_path, text))], ctx) == 4
        assert "data.path (line 10): " in err.getvalue()
        assert "is not a usable path (it holds the control character '\\n')" in err.getvalue()
        assert "checkpoint.dir (line 18): " in err.getvalue()
        assert "\n#SBATCH" not in err.getvalue()  # shown escaped, on one line
        return
    plan = plan_for(write_spec(tmp_path, text), {"LMLAUNCH_RUNS_ROOT": "/runs"})
    assert render_script(plan) == render_script(benign)
    again = LaunchPlan.from_dict(json.loads(plan.to_json()))
    assert again.spec["data"]["path"] == "/data/" + value
    assert again.paths.checkpoint_dir == "/ckpt/" + value


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_runs_root_is_rejected_or_rendered_exactly(value, tmp_path):
    root = str(tmp_path / "runs" / value)
    spec = write_spec(tmp_path, BASE)
    if SLURM_UNSAFE.search(value):
        out, err = io.StringIO(), io.StringIO()
        ctx = Context(stdout=out, stderr=err, environ={"LMLAUNCH_RUNS_ROOT": root})
        assert main(["submit", str(spec), "--dry-run"], ctx) == 4
        assert "which SLURM cannot take in a #SBATCH --output path" in err.getvalue()
        assert out.getvalue() == ""
        return
    plan = plan_for(spec, {"LMLAUNCH_RUNS_ROOT": root})
    assert plan.paths.run_dir == root + "/t"
    script = render_script(plan)
    assert sorted(slurm_directives(script)) == planned_directives(plan)
    assert f"--output={root}/t/submitit/%j_0_log.out" in slurm_directives(script)
    srun = shlex.split(next(line for line in script.split("\n") if line.startswith("srun ")))
    assert srun[srun.index("--output") + 1] == f"{root}/t/submitit/%j_%t_log.out"  # submitit's, then ours: the last wins
    assert [a for a in srun if a.startswith(("--output=", "--error="))] == [
        f"--output={root}/t/submitit/%j_node-%n_log.out", f"--error={root}/t/submitit/%j_node-%n_log.out"]
    assert srun[-1] == f"{root}/t/submitit"
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    env = run_setup_in_sandbox(script, sandbox)
    assert env["LMLAUNCH_RUN_DIR"] == root + "/t"
    assert list(sandbox.iterdir()) == []


def test_slurm_directive_parser_follows_sbatch_quoting():
    script = "#!/bin/bash\n#SBATCH --a='x y' --b=\"q'q\"\n#SBATCH --c=d # comment\necho\n#SBATCH --late=1\n"
    assert slurm_directives(script) == ["--a=x y", "--b=q'q", "--c=d"]


SITE_PROFILE = """\
partitions:
  batch: {max_time: "1:00:00"}
default_partition: batch
max_tasks_per_node: 4
runs_root: /runs
python: auto
setup: ["export PYTHONPATH=/opt/site-modules", "export CUDA_HOME=/opt/cuda"]
"""


def test_a_pythonpath_the_clusters_setup_gives_is_kept_after_the_code_snapshot(tmp_path):
    """A `module load` in the profile's setup (here its effect, an export) puts the site's packages
    on PYTHONPATH: the batch script puts the run's code snapshot first and keeps them after it.
    Without one, the snapshot alone: no empty entry, which would put the working directory on sys.path."""
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    (home / "profiles" / "site.yaml").write_text(SITE_PROFILE)
    spec = write_spec(tmp_path, BASE)
    environ = {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_HOME": str(home)}
    for cluster, inherited in (("site", ":/opt/site-modules"), (None, "")):
        plan = resolve(str(spec), [], cluster, environ, python=sys.executable).plan
        sandbox = tmp_path / f"sandbox-{cluster}"
        sandbox.mkdir()
        env = run_setup_in_sandbox(render_script(plan), sandbox)
        assert env["PYTHONPATH"] == plan.env["PYTHONPATH"] + inherited
        assert plan.env["PYTHONPATH"].endswith("/code/lmlaunch-code.zip")
    assert "kept after it" in plan.env_reasons["PYTHONPATH"]
