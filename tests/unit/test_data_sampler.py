"""ResumableDistributedSampler: seeded order, disjoint rank shards, exact resume, re-sharding."""

from __future__ import annotations

import itertools

import pytest
import torch

from lmtrain.data.loader import DataError, ResumableDistributedSampler


def make(n=24, w=1, r=0, seed=3, b=2, drop_last=True) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(
        n, world_size=w, rank=r, seed=seed, batch_size_per_rank=b, drop_last=drop_last
    )


def take(sampler: ResumableDistributedSampler, batches: int, *, advance: bool = True) -> list[list[int]]:
    """What a training loop does: draw micro-batches and report each one consumed."""
    it = iter(sampler)
    out = []
    for _ in range(batches):
        out.append(list(itertools.islice(it, sampler.batch_size_per_rank)))
        if advance:
            sampler.advance()
    return out


@pytest.mark.parametrize("n, w, b", [(24, 1, 2), (24, 2, 3), (25, 3, 2), (30, 4, 1), (7, 2, 3)])
def test_rank_shards_are_disjoint_and_their_union_is_the_epoch(n, w, b):
    samplers = [make(n, w, r, b=b) for r in range(w)]
    shards = [s.epoch_indices(0) for s in samplers]
    per_step = w * b
    usable = n // per_step * per_step  # drop_last: the tail that fills no whole step is skipped
    assert all(len(s) == usable // w for s in shards)
    union = [i for s in shards for i in s]
    assert len(set(union)) == len(union) == usable
    assert set(union) == set(samplers[0].permutation(0)[:usable].tolist())
    # The infinite iterator starts with exactly that epoch, then goes on with the next one.
    for s, shard in zip(samplers, shards, strict=True):
        assert list(itertools.islice(iter(s), len(shard))) == shard


def test_without_drop_last_every_sample_is_seen_each_epoch_and_ranks_stay_equal():
    n, w, b = 25, 2, 4
    shards = [make(n, w, r, b=b, drop_last=False).epoch_indices(0) for r in range(w)]
    assert len(shards[0]) == len(shards[1]) == 16  # ceil(25 / 8) = 4 steps of 2 x 4
    assert set(shards[0]) | set(shards[1]) == set(range(n))


def test_order_is_fixed_by_seed_and_reshuffled_every_epoch():
    a, b, other = make(seed=5), make(seed=5), make(seed=6)
    epoch0, epoch1 = a.epoch_indices(0), a.epoch_indices(1)
    assert epoch0 == b.epoch_indices(0)
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(24))
    assert other.epoch_indices(0) != epoch0
    g = torch.Generator()
    g.manual_seed(5 + 1)
    assert a.permutation(1).tolist() == torch.randperm(24, generator=g).tolist()


def test_infinite_iteration_crosses_epochs_in_order():
    s = make(n=10, w=2, r=1, b=2)  # 2 steps per epoch (8 of 10 samples)
    seen = list(itertools.islice(iter(s), 4 * 3))
    assert seen == s.epoch_indices(0) + s.epoch_indices(1) + s.epoch_indices(2)


@pytest.mark.parametrize("stop_after", [1, 5, 6, 7, 13])  # 6 batches per epoch: mid, boundary, after
def test_resume_from_state_dict_continues_the_uninterrupted_order(stop_after):
    w, total = 2, 16
    for rank in range(w):
        straight = take(make(24, w, rank), total)
        first = make(24, w, rank)
        head = take(first, stop_after)
        state = first.state_dict()
        resumed = make(24, w, rank)
        resumed.load_state_dict(state)
        assert head + take(resumed, total - stop_after) == straight


def test_state_dict_counts_consumed_batches_not_prefetched_ones():
    s = make(24, w=2, r=1, b=2)
    it = iter(s)
    drawn = list(itertools.islice(it, 8))  # four batches prefetched by workers ...
    s.advance()  # ... of which the loop has trained on one
    assert s.state_dict() == {
        "version": 1,
        "epoch": 0,
        "index": 2,
        "global_position": 4,
        "seed": 3,
        "world_size": 2,
        "batch_size_per_rank": 2,
        "dataset_len": 24,
        "drop_last": True,
    }
    resumed = make(24, w=2, r=1, b=2)
    resumed.load_state_dict(s.state_dict())
    assert list(itertools.islice(iter(resumed), 6)) == drawn[2:]


def test_state_dict_rolls_over_to_the_next_epoch():
    s = make(10, w=2, r=0, b=2)  # 2 steps per epoch
    take(s, 5)
    state = s.state_dict()
    assert (state["epoch"], state["index"], state["global_position"]) == (2, 2, 4)


@pytest.mark.parametrize("new_w, new_b", [(1, 6), (3, 2), (4, 3), (1, 1)])
def test_resume_on_a_different_world_size_reshards_from_the_global_position(new_w, new_b):
    n, w, b, steps = 60, 2, 3, 4
    old = [make(n, w, r, b=b) for r in range(w)]
    for s in old:
        take(s, steps)
    states = [s.state_dict() for s in old]
    assert all(st == {**states[0]} for st in states)  # every rank holds the same global position
    g = states[0]["global_position"]
    assert g == steps * w * b
    new = [make(n, new_w, r, b=new_b) for r in range(new_w)]
    for s in new:
        s.load_state_dict(states[0])
        assert s.resharded_from == ((w, b) if (w, b) != (new_w, new_b) else None)
    # Global order after resume: step by step, rank 0's batch, rank 1's batch, ...
    new_steps = (n - g) // (new_w * new_b)
    batches = [take(s, new_steps) for s in new]
    resumed_global = [i for k in range(new_steps) for r in range(new_w) for i in batches[r][k]]
    assert resumed_global == old[0].permutation(0)[g : g + new_steps * new_w * new_b].tolist()


def test_load_state_dict_rejects_a_different_seed_or_dataset():
    s = make(24, seed=3)
    take(s, 2)
    with pytest.raises(DataError, match=r"seeded with 3, this run with trainer\.seed\(4\)"):
        make(24, seed=4).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match=r"trained on 24 training samples, this run has 30"):
        make(30, seed=3).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match=r"lacks \['seed'\]"):
        make(24).load_state_dict({"epoch": 0, "index": 0, "world_size": 1})


def test_advance_only_takes_whole_micro_batches():
    s = make(24, b=4)
    s.advance(8)
    assert s.state_dict()["index"] == 8
    with pytest.raises(ValueError, match=r"multiple of batch_size_per_rank\(4\)"):
        s.advance(3)


def test_sampler_arguments_are_checked():
    with pytest.raises(ValueError, match=r"rank\(2\) must be in \[0, world_size\(2\)\)"):
        make(24, w=2, r=2)
    with pytest.raises(
        DataError, match=r"fewer than one global step of world_size\(4\) x micro_batch_size\(8\) = 32"
    ):
        make(24, w=4, b=8)
