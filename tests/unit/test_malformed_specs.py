"""Each malformed spec or command line in malformed_cases.CASES fails through the real CLI
entry (``launcher.cli.main``) with exit code 2, its exact message on stderr, nothing on
stdout, and no traceback. With LMLAUNCH_DEBUG=1 the exception propagates instead.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from lmcore.errors import SpecError
from tests.unit.malformed_cases import BASE, CASES, Case

NOHIGH_PROFILE = """\
partitions:
  batch: {max_time: "1:00:00"}
default_partition: batch
max_tasks_per_node: 4
runs_root: /runs
"""
BROKEN_PROFILE = NOHIGH_PROFILE + "gpu_per_node: 8\n"
BADPYTHON_PROFILE = NOHIGH_PROFILE + "python: '\"/opt/py'\n"
SCRATCH_PROFILE = NOHIGH_PROFILE.replace("runs_root: /runs", "runs_root: /scratch/$SCRATCH_GROUP/runs")


def run_case(case: Case, tmp_path: Path) -> tuple[int, str, str, str]:
    profiles = tmp_path / "profiles"
    profiles.mkdir(exist_ok=True)
    (profiles / "nohigh.yaml").write_text(NOHIGH_PROFILE)
    (profiles / "broken.yaml").write_text(BROKEN_PROFILE)
    (profiles / "scratch.yaml").write_text(SCRATCH_PROFILE)
    (profiles / "badpython.yaml").write_text(BADPYTHON_PROFILE)
    spec = tmp_path / "job.yaml"
    if case.text is not None:
        spec.write_text(case.text)
    # LMLAUNCH_HOME of its own: the messages that list the available profiles must not see the
    # user's own (~/.lmlaunch/profiles expands with the process's HOME, not this environment's)
    environ = {"HOME": "/home/u", "USER": "u", "LMLAUNCH_RUNS_ROOT": "/runs", "PATH": "/usr/bin",
               "LMLAUNCH_HOME": str(tmp_path / "home")}
    environ.update({k: v.replace("{profiles}", str(profiles)) for k, v in case.environ.items()})
    out, err = io.StringIO(), io.StringIO()
    ctx = Context(stdout=out, stderr=err, environ=environ, python="/opt/venv/bin/python")
    code = main([case.command, str(spec), *case.argv], ctx)
    return code, out.getvalue(), err.getvalue(), str(spec)


def test_there_are_at_least_40_malformed_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_exits_4_with_exact_message(case: Case, tmp_path, monkeypatch):
    monkeypatch.delenv("LMLAUNCH_DEBUG", raising=False)
    code, out, err, spec = run_case(case, tmp_path)
    assert code == (2 if case.id == "missing_file" else 4)  # a file argument naming nothing: a usage error
    assert out == ""
    assert "Traceback" not in err
    assert err == "error: " + case.expected.replace("{spec}", spec).replace(
        "{profiles}", str(tmp_path / "profiles")
    ) + "\n"


def test_the_base_spec_of_the_malformed_cases_is_valid(tmp_path, monkeypatch):
    monkeypatch.delenv("LMLAUNCH_DEBUG", raising=False)
    code, out, err, _ = run_case(Case("base", BASE, ""), tmp_path)
    assert (code, err) == (0, "")
    assert out.startswith("ok: ")


def test_debug_variable_shows_the_exception_instead(tmp_path, monkeypatch):
    monkeypatch.setenv("LMLAUNCH_DEBUG", "1")
    case = next(c for c in CASES if c.id == "unknown_key_nested")
    with pytest.raises(SpecError, match="did you mean 'nodes'"):
        run_case(case, tmp_path)
