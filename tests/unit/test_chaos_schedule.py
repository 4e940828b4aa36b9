"""The chaos campaign's schedule (tests/chaos_schedule.py): drawn from its seed alone, replayed as
saved, every fault inside the run and after its first checkpoint, the kinds it must hold."""

from __future__ import annotations

import pytest
from chaos_schedule import KINDS, Schedule, draw
from hypothesis import given, settings, strategies as st


@settings(max_examples=60, deadline=None)  # deadline: the wait rules (tests/unit/test_waits.py)
@given(seed=st.integers(0, 2**31), faults=st.integers(1, 12), every=st.integers(2, 10), overlap=st.floats(0, 1))
def test_a_seed_gives_one_schedule_inside_the_run_and_it_replays_as_saved(seed, faults, every, overlap):
    max_steps = every * 2 + faults + 5
    one = draw(seed, faults=faults, max_steps=max_steps, every=every, overlap_p=overlap)
    assert one == draw(seed, faults=faults, max_steps=max_steps, every=every, overlap_p=overlap)
    assert Schedule.from_json(one.to_json()) == one
    steps = [f.after_step for f in one.faults]
    assert len(steps) == faults and steps == sorted(set(steps))  # a step of its own each: progress between them
    assert all(every < s <= max_steps - every for s in steps)  # after the first checkpoint, before the last interval
    assert not one.faults[0].overlap and all(f.kind in KINDS for f in one.faults)
    for f in one.faults:
        low, high = KINDS[f.kind].hold
        assert low <= f.hold_s <= high and 0 <= f.target < one.ranks


def test_the_kinds_a_schedule_must_hold_are_in_it_and_bad_settings_are_refused():
    for seed in range(20):
        kinds = draw(seed, faults=3, max_steps=80, every=10, must=("rank_kill", "node_down")).kinds()
        assert kinds.get("rank_kill", 0) >= 1 and kinds.get("node_down", 0) >= 1
    assert len({draw(seed, faults=4, max_steps=80, every=10).faults for seed in range(20)}) == 20
    few = {"preempt": KINDS["preempt"]}  # the must kinds come from the whole catalogue, the rest from kinds
    for seed in range(10):
        assert sorted(draw(seed, faults=3, max_steps=80, every=10, must=("node_down",), kinds=few).kinds()) == [
            "node_down", "preempt"]
    overlapped = 0
    for seed in range(30):  # an alone kind never overlaps, nor is overlapped; the others still do
        faults = draw(seed, faults=6, max_steps=200, every=10, overlap_p=0.9, alone=("rank_kill",)).faults
        assert all(not f.overlap for i, f in enumerate(faults)
                   if f.kind == "rank_kill" or (i and faults[i - 1].kind == "rank_kill"))
        overlapped += sum(f.overlap for f in faults)
    assert overlapped > 30
    with pytest.raises(ValueError, match="unknown"):
        draw(1, faults=2, max_steps=80, every=10, must=("meteor",))
    with pytest.raises(ValueError, match="do not fit"):
        draw(1, faults=10, max_steps=24, every=10)
    bad = draw(1, faults=1, max_steps=80, every=10).to_json().replace(f'"{draw(1, faults=1, max_steps=80, every=10).faults[0].kind}"', '"meteor"')
    with pytest.raises(ValueError, match="meteor"):
        Schedule.from_json(bad)
