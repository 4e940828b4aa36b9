"""`lmlaunch profile RUN`'s bad input, refused before anything is written (the running case is
tests/integration/test_profile_on_cluster.py), and the `profile` word shared with `profile init`."""

from __future__ import annotations

import io

import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.monitor.profile_tables import parse_ranks, side_by_side
from lmcore.errors import UserError


def _lm(*args: str, home) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), Context(stdout=out, stderr=err, environ={"LMLAUNCH_HOME": str(home)}))
    return code, err.getvalue()


@pytest.mark.parametrize("argv, words", [
    (["profile", "somerun", "--steps", "0"], "--steps 0: profile 1 to 1000 steps"),
    (["profile", "--steps", "1001", "somerun"], "--steps 1001: profile 1 to 1000 steps"),  # options first
    (["profile", "run", "init"], "no run named or with job id 'init'"),  # a run named init
    (["profile", "somerun"], "no run named or with job id 'somerun'"),
])
def test_bad_profile_requests_are_refused_with_what_is_wrong(tmp_path, argv, words):
    code, err = _lm(*argv, home=tmp_path)
    assert code == 2 and words in err, err


@pytest.mark.parametrize("text, world, got", [(None, 4, None), ("1,0,1", 2, [0, 1]), ("3", 4, [3])])
def test_ranks_parse(text, world, got):
    assert parse_ranks(text, world) == got


@pytest.mark.parametrize("text, words", [("2", "rank 2 is not a rank of this job: its ranks are 0..1"),
                                         ("x", "give global ranks as numbers"), (",", "at least one rank")])
def test_ranks_outside_the_job_are_refused(text, words):
    with pytest.raises(UserError, match=words):
        parse_ranks(text, 2)


def test_the_tables_stand_side_by_side_with_the_longest_names_cut():
    tables = [{"rank": r, "node": f"n{r + 1}", "from_step": 11, "to_step": 12,
               "ops": [{"name": "aten::mm", "self_s": 0.3}, {"name": "x" * 80, "self_s": 0.1}]} for r in (0, 1)]
    text = side_by_side(tables, top=2)
    lines = text.splitlines()
    assert lines[0] == "top operators by self time, steps 11-12:"
    assert "rank 0 (n1)" in lines[1] and "rank 1 (n2)" in lines[1]
    assert lines[2].count("aten::mm") == 2 and lines[2].count("300.0") == 2 and "…" in lines[3]
