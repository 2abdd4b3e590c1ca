"""``pinfeed.elastic``: the rest of an interrupted epoch over another world size, checked
against torch's own DistributedSampler for the old ranks' shards: every sample of the
epoch is delivered once (beyond the stated padding, and for ``drop_last`` the stated
cut), every new rank gets the same number of batches, and a second resize in the
same epoch keeps the promise. Pure: no server."""

from __future__ import annotations

import collections
import math
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from pinfeed import InvalidState, merge_states
from pinfeed import elastic as el_mod
from pinfeed.elastic import (
    STATE_VERSION,
    Elastic,
    Plan,
    Target,
    resume,
    spread,
    stage_samples,
)


class _Len:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _state(plan: Plan, rank: int, world: int, batch: int, pos: tuple[int, int], el: Any = None):
    return {
        "version": STATE_VERSION,
        "loader": f"l-{rank}",
        "epoch": pos[0],
        "index": pos[1],
        "rank": rank,
        "world_size": world,
        "batch_size": batch,
        "plan": plan.to_json(),
        "elastic": el or el_mod.NO_ELASTIC,
    }


def _shard(plan: Plan, world: int, rank: int, epoch: int) -> list[int]:
    s = DistributedSampler(
        _Len(plan.length),
        num_replicas=world,
        rank=rank,
        shuffle=plan.shuffle,
        seed=plan.seed,
        drop_last=plan.drop_last,
    )
    s.set_epoch(epoch)
    return list(s)


def _batches(samples: list[int], batch: int, drop_last: bool) -> list[list[int]]:
    out = [samples[i : i + batch] for i in range(0, len(samples), batch)]
    return [b for b in out if len(b) == batch] if drop_last else out


CASES = [
    # n, old world, batch, consumed batches per old rank, new world, new batch
    (300, 4, 5, [6, 6, 6, 6], 3, 5),
    (300, 4, 5, [6, 6, 6, 6], 6, 5),
    (301, 4, 5, [7, 7, 6, 7], 6, 4),
    (97, 4, 3, [2, 2, 2, 2], 7, 3),
    (50, 3, 4, [0, 1, 5, 2], 2, 4),
    (40, 2, 4, [3, 5], 3, 4),  # rank 1 finished its shard
]


@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "drop"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "ordered"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}to{c[4]}" for c in CASES])
def test_every_sample_of_the_epoch_once(case: Any, shuffle: bool, drop_last: bool) -> None:
    n, world, batch, consumed, new_world, new_batch = case
    plan = Plan(n, shuffle, 9, drop_last)
    epoch = 2
    delivered: collections.Counter[int] = collections.Counter()
    states = []
    deliverable: set[int] = set()
    for rank in range(world):
        batches = _batches(_shard(plan, world, rank, epoch), batch, drop_last)
        deliverable |= {i for b in batches for i in b}
        k = min(consumed[rank], len(batches))
        for b in batches[:k]:
            delivered.update(b)
        pos = (epoch + 1, 0) if k == len(batches) else (epoch, k)
        states.append(_state(plan, rank, world, batch, pos))
    merged = merge_states(states[::-1])  # any order
    assert merged["ranks"] == [[s["epoch"], s["index"]] for s in states]
    old = sum(delivered.values())
    lengths = set()
    for rank in range(new_world):
        got = resume(merged, Target(plan, rank, new_world, new_batch, streams=2))
        if got.elastic is None:  # too few left for one batch on every rank: all cut
            assert drop_last and (got.epoch, got.index) == (epoch + 1, 0)
            lengths.add(0)
            continue
        assert got.epoch == epoch and got.index == got.elastic.start
        assert got.index % 2 == 0 and got.index >= max(s["index"] for s in states)
        mine = stage_samples(plan, got.elastic, new_world, rank, new_batch).tolist()
        lengths.add(len(mine))
        delivered.update(mine)
    assert len(lengths) == 1, "every new rank gets as many samples (and batches)"
    if drop_last:
        # Exactly once; what is not delivered is the old run's own cut plus under
        # new_world * new_batch samples cut from the remainder.
        assert all(c == 1 for c in delivered.values())
        assert set(delivered) <= deliverable
        assert len(deliverable) - len(delivered) < new_world * new_batch
        assert lengths.pop() % new_batch == 0
    else:
        # Every sample at least once; beyond once only padding: the old shards' (the
        # original run's own) and under new_world new samples.
        assert set(delivered) == set(range(n))
        old_padding = world * math.ceil(n / world) - n
        extra = sum(delivered.values()) - n
        assert extra < old_padding + new_world
        assert sum(delivered.values()) - old == lengths.pop() * new_world


def test_a_second_resize_in_the_same_epoch() -> None:
    plan = Plan(500, True, 3, False)
    epoch = 0
    delivered: collections.Counter[int] = collections.Counter()
    states = []
    for rank in range(8):  # 8 ranks, 4 batches of 6 each
        batches = _batches(_shard(plan, 8, rank, epoch), 6, False)
        for b in batches[:4]:
            delivered.update(b)
        states.append(_state(plan, rank, 8, 6, (0, 4)))
    first = merge_states(states)
    second = []
    for rank in range(5):  # resumed on 5 ranks with batches of 7; 3 batches each, then 3
        got = resume(first, Target(plan, rank, 5, 7, streams=3))
        assert got.elastic is not None
        assert got.index == 6  # after batch 4 of the old stage, a multiple of 3 streams
        mine = stage_samples(plan, got.elastic, 5, rank, 7).tolist()
        batches = _batches(mine, 7, False)
        for b in batches[:3]:
            delivered.update(b)
        el = got.elastic.to_json()
        second.append(_state(plan, rank, 5, 7, (0, got.index + 3), el))
    merged = merge_states(second)
    for rank in range(3):  # and then on 3 ranks
        got = resume(merged, Target(plan, rank, 3, 7, streams=0))
        assert got.elastic is not None and len(got.elastic.stages) == 2
        assert got.index == 9
        delivered.update(stage_samples(plan, got.elastic, 3, rank, 7).tolist())
    assert set(delivered) == set(range(500))
    assert sum(delivered.values()) - 500 < (8 * 63 - 500) + 5 + 3  # paddings only


def test_same_world_goes_on_from_each_ranks_own_position() -> None:
    plan = Plan(64, True, 1, False)
    states = [_state(plan, r, 4, 4, (1, 2 + r % 2)) for r in range(4)]
    merged = merge_states(states)
    for rank in range(4):
        got = resume(merged, Target(plan, rank, 4, 4, streams=2))
        assert (got.epoch, got.index, got.elastic) == (1, 2 + rank % 2, None)
    # One rank's own state: that rank, and only it.
    assert resume(states[1], Target(plan, 1, 4, 4, 2)).index == 3
    with pytest.raises(InvalidState, match="rank 1's, not rank 2's"):
        resume(states[1], Target(plan, 2, 4, 4, 2))
    with pytest.raises(InvalidState, match="needs every rank's position"):
        resume(states[1], Target(plan, 1, 3, 4, 2))


def test_nobody_inside_an_epoch_starts_it_afresh() -> None:
    plan = Plan(64, True, 1, True)
    at_start = merge_states([_state(plan, r, 4, 4, (3, 0)) for r in range(4)])
    assert resume(at_start, Target(plan, 0, 2, 4, 0)) == resume(at_start, Target(plan, 1, 2, 4, 0))
    assert resume(at_start, Target(plan, 1, 2, 4, 0)).index == 0
    done = merge_states([_state(plan, r, 4, 4, (4, 0)) for r in range(4)])
    got = resume(done, Target(plan, 1, 8, 4, 0))
    assert (got.epoch, got.index, got.elastic) == (4, 0, None)


def test_a_remainder_too_small_for_a_batch_goes_to_the_next_epoch() -> None:
    plan = Plan(40, False, 1, True)  # 4 ranks x 10 samples; 2 batches of 4 each (2 cut)
    merged = merge_states([_state(plan, r, 4, 4, (0, 2)) for r in range(4)])
    # The old stage's cut samples are not due: nothing is left.
    got = resume(merged, Target(plan, 0, 3, 4, 0))
    assert (got.epoch, got.index, got.elastic) == (1, 0, None)


def test_refusals_say_why() -> None:
    plan = Plan(64, True, 1, False)
    states = [_state(plan, r, 4, 4, (0, 1)) for r in range(4)]
    with pytest.raises(InvalidState, match=r"ranks \[2\] are missing"):
        merge_states(states[:2] + states[3:])
    with pytest.raises(InvalidState, match="two states of rank 1"):
        merge_states([*states, states[1]])
    other = _state(Plan(64, True, 2, False), 3, 4, 4, (0, 1))
    with pytest.raises(InvalidState, match="disagree on 'plan'"):
        merge_states([*states[:3], other])
    merged = merge_states(states)
    with pytest.raises(InvalidState, match="another plan"):
        resume(merged, Target(Plan(65, True, 1, False), 0, 2, 4, 0))
    apart = merge_states([_state(plan, r, 4, 4, (0, 1) if r else (2, 1)) for r in range(4)])
    with pytest.raises(InvalidState, match="more than one epoch apart"):
        resume(apart, Target(plan, 0, 2, 4, 0))
    with pytest.raises(InvalidState, match="version 2"):
        merge_states([{"epoch": 0, "index": 1}])
    with pytest.raises(InvalidState, match="without world_size"):
        merge_states([{**states[0], "world_size": None}])
    far = merge_states([_state(plan, r, 4, 4, (0, 9)) for r in range(4)])  # 4 batches each
    with pytest.raises(InvalidState, match="not of one run"):
        resume(far, Target(plan, 0, 2, 4, 0))
    # InvalidState is a ValueError, as a bad state_dict is for torch.
    assert issubclass(InvalidState, ValueError)


def test_spread_is_distributed_samplers() -> None:
    for n, world, drop in [(10, 3, False), (10, 3, True), (2, 5, False), (9, 3, True)]:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
        for rank in range(world):
            g = torch.Generator().manual_seed(n)
            perm = torch.randperm(n, generator=g).tolist()
            total = math.ceil((n - world) / world) if drop and n % world else math.ceil(n / world)
            total *= world
            full = perm[:total] if drop else (perm * world)[:total]
            assert spread(order, world, drop)[rank::world].tolist() == full[rank:total:world]


def test_the_record_round_trips() -> None:
    plan = Plan(64, True, 1, False)
    merged = merge_states([_state(plan, r, 4, 4, (0, 3)) for r in range(4)])
    got = resume(merged, Target(plan, 0, 2, 4, 0))
    assert got.elastic is not None
    assert Elastic.from_json(got.elastic.to_json()) == got.elastic
    assert Plan.from_json(plan.to_json()) == plan
