"""Slow ranks: the scorer as tables (lmtrain.health.stragglers), the watch over real timing files
(lmtrain.health.straggler_watch), the spec's bad input, and what status shows of a ledger's
straggler lines. The slow rank on the real cluster: tests/integration/test_stragglers_on_cluster.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from launcher.monitor import status_rows as monitor
from launcher.monitor.run_files import RunFiles
from launcher.monitor.slurm_view import SlurmJob
from launcher.runs import registry as runs
from lmcore.job.parallelism import Parallelism
from lmcore.run import straggler_lines
from lmcore.run.rundir import Ledger
from lmtrain.health.straggler_watch import StragglerWatch, TimingTable
from lmtrain.health.stragglers import Slow, StragglerPolicy, others_median, score

POLICY = StragglerPolicy(threshold=1.5, window=3)


def _table(*rows):
    return np.array(rows, dtype=float)


# (name, table[interval][rank], slow ranks found)
CASES = [
    ("every rank alike", _table([1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]), []),
    ("one rank 1.8x its peers in every interval of the window",
     _table([1, 1, 1.8, 1], [1, 1, 1.9, 1], [1, 1, 2.0, 1]), [Slow(2, 1.8, "peers")]),
    ("slow in 2 intervals of 3: not yet", _table([1, 1, 1, 1], [1, 1, 2, 1], [1, 1, 2, 1]), []),
    ("just under the threshold", _table([1, 1.49], [1, 1.49], [1, 1.49]), []),
    ("two ranks: the other's median, so 1.6x is slow", _table([1, 1.6], [1, 1.6], [1, 1.6]), [Slow(1, 1.6, "peers")]),
    ("fewer intervals than the window", _table([1, 3], [1, 3]), []),
    ("a rank that has not written is never slow", _table([1, np.nan, 1], [1, np.nan, 1], [1, np.nan, 1]), []),
    ("one rank alone: no peers, no history", _table([1], [5], [9]), []),
    ("the slowest first", _table([1, 1, 2, 3, 1], [1, 1, 2, 3, 1], [1, 1, 2, 3, 1]),
     [Slow(3, 3.0, "peers"), Slow(2, 2.0, "peers")]),
    ("every rank slower than its own history (a shared slowdown)",
     _table([1, 1], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]), [Slow(0, 2.0, "self"), Slow(1, 2.0, "self")]),
    ("own history needs a window of earlier intervals", _table([1, 1], [2, 2], [2, 2], [2, 2]), []),
    ("slow against peers and itself: the larger factor",
     _table([1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 3], [1, 1, 3], [1, 1, 3]), [Slow(2, 3.0, "peers")]),
    ("recovered: the last interval is fine", _table([1, 2], [1, 2], [1, 2], [1, 1]), []),
]


@pytest.mark.parametrize("name, table, slow", CASES, ids=[c[0] for c in CASES])
def test_the_scorer_flags_a_rank_slow_for_the_whole_window(name, table, slow):
    assert score(table, POLICY) == slow


@pytest.mark.parametrize("threshold, window, words", [
    (1.0, 3, "threshold(1.0) must be above 1"), (0.5, 3, "must be above 1"), (1.5, 0, "window(0) must be at least 1")])
def test_a_policy_that_cannot_work_is_refused(threshold, window, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        StragglerPolicy(threshold=threshold, window=window)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.one_of(st.floats(0.001, 100), st.just(float("nan"))), min_size=1, max_size=12))
def test_the_others_median_is_the_median_of_the_other_ranks(values):
    row = np.array(values)
    got = others_median(row)
    for i, v in enumerate(values):
        others = [x for j, x in enumerate(values) if j != i and not np.isnan(x)]
        if np.isnan(v) or not others:
            assert np.isnan(got[i])
        else:
            assert got[i] == pytest.approx(float(np.median(others)))


def test_8192_ranks_are_scored_in_well_under_a_second():
    rng = np.random.default_rng(0)
    table = rng.normal(1.0, 0.05, size=(64, 8192))
    table[-3:, 4321] *= 2.0  # one slow rank
    began = time.perf_counter()
    slow = score(table, POLICY)
    took = time.perf_counter() - began
    assert [s.rank for s in slow] == [4321] and took < 1.0, took


def _write(path, step, rank, forward, *, steps=5, wall=1.0, node="n1"):
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "steps": steps, "rank": rank, "node": node, "forward_s": forward * steps,
                            "wall_s": wall}) + "\n")


def test_the_watch_records_a_slow_rank_when_it_starts_and_when_it_ends(tmp_path):
    paths = [tmp_path / f"timing-rank-{r}.jsonl" for r in range(4)]
    ledger = Ledger(tmp_path / "attempts.jsonl")
    sent = []
    watch = StragglerWatch(paths, POLICY, attempt=2, ledger=ledger, notify=lambda *a, **k: sent.append((a, k)))
    step = 0
    for slow_factor in (1, 1, 1, 2, 2, 2, 1):
        step += 5
        for rank in range(4):
            _write(paths[rank], step, rank, 0.1 * (slow_factor if rank == 1 else 1), node=f"n{rank // 2 + 1}")
        watch.look()
    lines = [e for e in ledger.entries() if e["event"] == "straggler"]
    assert [(e["state"], e["rank"], e["node"], e["factor"], e["against"], e["step"], e["attempt"]) for e in lines] == [
        ("start", 1, "n1", 2.0, "peers", 30, 2), ("end", 1, "n1", 2.0, "peers", 35, 2)]
    assert [a[0] for a, _ in sent] == ["straggler", "straggler"]
    assert sent[0][0][1] == "rank 1 (n1) 2.0x the median compute"


def test_short_logging_intervals_are_summed_until_they_span_the_minimum(tmp_path):
    paths = [tmp_path / f"timing-rank-{r}.jsonl" for r in range(2)]
    table = TimingTable(paths, min_interval_s=3.0)
    for i, step in enumerate(range(5, 45, 5)):  # 8 logging intervals of 1 s: 2 scored intervals of 3 s, 2 rows left
        _write(paths[0], step, 0, 0.1)
        _write(paths[1], step, 1, 0.1 if i % 2 else 0.4)  # a blip every other interval
    table.read()
    assert table.table().shape == (2, 2) and table.last_step == 30
    assert table.table()[0] == pytest.approx([0.1, 0.3])  # (0.4 + 0.1 + 0.4) / 3 per step


def test_a_row_waits_for_every_rank_until_enough_newer_rows_exist(tmp_path):
    from lmtrain.health.straggler_watch import LATE_ROWS

    paths = [tmp_path / f"timing-rank-{r}.jsonl" for r in range(2)]
    table = TimingTable(paths)
    for step in range(5, 5 * (LATE_ROWS + 1), 5):  # rank 1's lines show late (another node, NFS)
        _write(paths[0], step, 0, 0.1)
    table.read()
    assert table.table().shape == (0, 2)
    _write(paths[1], 5, 1, 0.1)  # its first line arrives: that row is complete
    table.read()
    assert table.table().shape == (1, 2) and not np.isnan(table.table()).any()
    for step in range(5 * (LATE_ROWS + 1), 5 * (LATE_ROWS + 3), 5):  # now LATE_ROWS rows are newer than step 10
        _write(paths[0], step, 0, 0.1)
    table.read()
    assert table.table().shape == (2, 2) and np.isnan(table.table()[1, 1])  # missing there: never slow


def test_status_names_the_slow_rank_of_the_current_attempt_only(tmp_path):
    ledger = [
        {"event": "start", "attempt": 1},
        {"event": "straggler", "attempt": 1, "state": "start", "rank": 0, "node": "n1", "factor": 3.0, "against": "peers"},
        {"event": "start", "attempt": 2},
        {"event": "straggler", "attempt": 2, "state": "start", "rank": 1, "node": "n2", "factor": 1.8, "against": "peers"},
        {"event": "straggler", "attempt": 2, "state": "start", "rank": 3, "node": "n2", "factor": 1.6, "against": "self"},
        {"event": "straggler", "attempt": 2, "state": "end", "rank": 3, "node": "n2", "factor": 1.6, "against": "self"},
    ]
    assert [s["rank"] for s in straggler_lines.slow_ranks(ledger)] == [1]
    rec = runs.RunRecord(name="r", profile="local", run_dir=str(tmp_path), spec_path=None, job_ids=["8"])
    row = monitor.build_row(rec, RunFiles(ledger=ledger), SlurmJob("8", "RUNNING", None, 1), slurm_reachable=True,
                            now=0.0)
    assert "slow: rank 1 (n2) 1.8x the median compute" in row.note
    assert [(s["rank"], s["node"], s["factor"]) for s in row.stragglers] == [(1, "n2", 1.8)]
    done = monitor.build_row(rec, RunFiles(ledger=ledger), None, slurm_reachable=True, now=0.0)
    assert done.stragglers == [] and "slow" not in done.note  # only while it runs


def test_history_says_when_a_rank_was_slow_and_when_it_no_longer_was():
    from launcher.monitor.history_rows import build_history

    ledger = [
        {"event": "start", "attempt": 1, "job_id": "7", "start_step": 0, "time": 0.0},
        {"event": "straggler", "attempt": 1, "state": "start", "rank": 1, "node": "n2", "factor": 1.8,
         "against": "peers", "step": 40},
        {"event": "straggler", "attempt": 1, "state": "end", "rank": 1, "node": "n2", "factor": 1.8,
         "against": "peers", "step": 90},
    ]
    notes = build_history("r", ledger, [], now=10.0).notes
    assert "attempt 1: from step 40, slow: rank 1 (n2) 1.8x the median compute" in notes
    assert "attempt 1: from step 90, rank 1 (n2) no longer slow (it was 1.8x the median compute)" in notes


def test_a_pipelines_stages_are_compared_only_with_the_same_stage_of_other_replicas(tmp_path):
    """dp2 x pp2: the stages differ by design (the last computes the head): stage 1's ranks 1.6x
    stage 0's are nobody's straggler; a rank 2x its own stage's other replica is."""
    par = Parallelism.of("fsdp", 4, pipeline=2)
    assert par.peer_groups() == [[0, 2], [1, 3]]
    paths = [tmp_path / f"timing-rank-{r}.jsonl" for r in range(4)]
    ledger = Ledger(tmp_path / "attempts.jsonl")
    watch = StragglerWatch(paths, POLICY, attempt=1, ledger=ledger, peers=par.peer_groups())
    step = 0
    for slow_factor in (1, 1, 1, 1, 2, 2, 2):
        step += 5
        for rank in range(4):
            stage = 1.6 if rank % 2 else 1.0
            _write(paths[rank], step, rank, 0.1 * stage * (slow_factor if rank == 3 else 1))
        watch.look()
    lines = [e for e in ledger.entries() if e["event"] == "straggler"]
    assert [(e["state"], e["rank"], e["factor"], e["against"]) for e in lines] == [("start", 3, 2.0, "peers")], lines
