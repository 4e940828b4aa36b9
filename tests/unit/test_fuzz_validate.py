"""Fuzz `lmlaunch validate` with random YAML documents, random values on real keys and random
override strings (hypothesis, bounded in examples and per-example time).

Every input ends in exit 0 or in exit 2 with one 'error:' message and no traceback. Whatever
validates renders a job script that `bash -n` accepts and in which sbatch reads exactly the
#SBATCH directives the plan holds.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel

from launcher.cli import main
from launcher.context import Context
from launcher.planning.resolve import resolve
from launcher.submit.script import render_script
from lmcore.job.spec import JobSpec
from tests.unit.malformed_cases import BASE
from tests.unit.test_hostile_strings import planned_directives, slurm_directives

FUZZ = settings(
    max_examples=120,
    deadline=None,  # no per-example clock: examples render scripts and may start processes (a slow host is no failure);
    # a runaway parse is caught by test_hostile_input's hang guards
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples every run: a failure reproduces, CI does not flake
    database=None,
)


def _key_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, fld in model.model_fields.items():
        path = prefix + (name,)
        paths.append(path)
        for arg in (fld.annotation, *getattr(fld.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths.extend(_key_paths(arg, path))
    return paths


KEY_PATHS = _key_paths(JobSpec) + [("model", "config", "n_layer"), ("env", "vars", "X"), ("bogus",)]

NASTY_TEXT = st.sampled_from(
    ["ok\n", "a\n#SBATCH --partition=high", "$(touch canary)", "x'; echo y", "\x1b[2J", "é" * 300,
     "a\rb", "\x00", "low", "64G", "01:00:00", "1-00:00:00\n", "", " ", "%j", "\\", "-x", "*"]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=80),
    NASTY_TEXT,
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)),
    max_leaves=12,
)


def _validate(tmp_path: Path, text: str, overrides: list[str]) -> tuple[int, str, str, Path]:
    spec = tmp_path / "job.yaml"
    spec.write_text(text, encoding="utf-8", errors="surrogatepass")
    out, err = io.StringIO(), io.StringIO()
    environ = {"HOME": str(tmp_path), "USER": "u", "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}
    ctx = Context(stdout=out, stderr=err, environ=environ, python=sys.executable)
    code = main(["validate", str(spec), *overrides], ctx)
    return code, out.getvalue(), err.getvalue(), spec


def _check(tmp_path: Path, text: str, overrides: list[str]) -> None:
    code, out, err, spec = _validate(tmp_path, text, overrides)
    assert code in (0, 4), (code, err[-1500:])
    assert "Traceback" not in err
    if code == 4:
        assert err.startswith("error: ") and out == "", err[:500]
        assert len(err) < 5000
        return
    environ = {"HOME": str(tmp_path), "USER": "u", "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}
    plan = resolve(str(spec), overrides, None, environ, python=sys.executable).plan
    script = render_script(plan)
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0, script
    directives = slurm_directives(script)
    # an evaluator alongside is the heterogeneous job's second component (after `hetjob`: its own
    # partition, nodes and CPUs, tests/unit/test_eval_alongside*.py); the trainer's is the plan's
    assert ("hetjob" in directives) == bool(plan.evaluator), directives
    first = directives[: directives.index("hetjob")] if "hetjob" in directives else directives
    assert sorted(first) == planned_directives(plan)


def _with(doc: dict, path: tuple[str, ...], value) -> dict:
    node = doc
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value
    return doc


@pytest.fixture(scope="module")
def base_doc() -> dict:
    return yaml.safe_load(BASE)


@FUZZ
@given(text=st.text(max_size=400))
def test_random_text_as_a_spec_validates_or_fails_cleanly(text, tmp_path):
    _check(tmp_path, text, [])


@FUZZ
@given(text=st.text(max_size=200))
def test_random_text_appended_to_a_valid_spec_validates_or_fails_cleanly(text, tmp_path):
    _check(tmp_path, BASE + text, [])


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(KEY_PATHS), VALUES), min_size=1, max_size=3))
def test_random_values_on_real_keys_validate_or_fail_cleanly(edits, base_doc, tmp_path):
    doc = yaml.safe_load(BASE)
    for path, value in edits:
        doc = _with(doc, path, value)
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    _check(tmp_path, text, [])


@FUZZ
@given(
    overrides=st.lists(
        st.one_of(
            st.text(max_size=60),
            st.builds(lambda p, v: ".".join(p) + "=" + v, st.sampled_from(KEY_PATHS), st.one_of(st.text(max_size=40), NASTY_TEXT)),
        ),
        max_size=3,
    )
)
def test_random_overrides_validate_or_fail_cleanly(overrides, tmp_path):
    # argparse reads an argument starting with '-' as an option; the CLI refuses those itself
    _check(tmp_path, BASE, [o for o in overrides if not o.startswith("-")])


@FUZZ
@given(
    values=st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True), st.text(max_size=60), min_size=1, max_size=4),
    path=st.text(min_size=1, max_size=40),
    time=st.one_of(st.integers(min_value=3, max_value=600), st.from_regex(r"0?[1-9]:[0-5][0-9]:[0-5][0-9]\n?", fullmatch=True)),
)
def test_random_env_values_paths_and_times_that_validate_render_a_sound_script(values, path, time, tmp_path):
    doc = yaml.safe_load(BASE)
    doc["env"] = {"vars": {k: v for k, v in values.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SUBMITIT_"))}}
    doc["data"]["path"] = path
    doc["checkpoint"] = {"dir": path + "/ckpt"}
    doc["resources"]["time"] = time
    _check(tmp_path, yaml.safe_dump(doc, allow_unicode=True), [])
