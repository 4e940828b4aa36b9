"""`submit --after RUN[:ok|:any]` in the dry run: the script carries the dependency exactly as it
would be submitted (no SLURM call); a bad reference is refused with the known runs."""

from __future__ import annotations

import io
import json

import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.runs import registry as runs


@pytest.fixture
def env(tmp_path):
    environ = {"LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}
    for name, job in (("train", "123"), ("prep", "77")):
        runs.save_record(runs.RunRecord(name=name, profile="local", run_dir=str(tmp_path / "runs" / name),
                                        spec_path=None, job_ids=[job]), environ)
    return environ


def _dry(repo, env, *after: str) -> tuple[int, str]:
    out = io.StringIO()
    args = ["submit", str(repo / "jobs" / "tiny-cpu.yaml"), "--dry-run", "--json"]
    for a in after:
        args += ["--after", a]
    code = main(args, Context(stdout=out, stderr=out, environ=env))
    return code, out.getvalue()


def test_the_dependency_is_in_the_script(repo, env):
    code, out = _dry(repo, env, "train", "prep:any")
    assert code == 0, out
    assert "#SBATCH --dependency=afterok:123,afterany:77\n" in json.loads(out)["script"]
    code, out = _dry(repo, env)
    assert "--dependency" not in json.loads(out)["script"]
    code, out = _dry(repo, env, "train", "singleton")  # one job of this name at a time
    assert code == 0 and "#SBATCH --dependency=afterok:123,singleton\n" in json.loads(out)["script"], out


def test_an_unknown_run_is_refused(repo, env):
    code, out = _dry(repo, env, "nosuch:ok")
    assert code == 2 and "no run named or with job id 'nosuch'" in out and "train" in out, out
