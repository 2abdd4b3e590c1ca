"""The sampler against DataLoader's own samplers, in-process (no server)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from pinfeed_server.engine.sampler import EpochSampler, with_last


def _dataloader_epochs(n: int, batch: int, seed: int, drop_last: bool, epochs: int) -> list:
    loader = DataLoader(
        list(range(n)),
        batch_size=batch,
        shuffle=True,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
    )
    return [[b.tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_epochs_equal_dataloaders(drop_last: bool) -> None:
    sampler = EpochSampler(23, 5, shuffle=True, seed=7, drop_last=drop_last)
    expected = _dataloader_epochs(23, 5, 7, drop_last, 3)
    assert [list(sampler.batches(e)) for e in range(3)] == expected
    assert len(sampler) == len(expected[0])
    # Random access backwards (a resume) replays from the seed.
    assert list(sampler.batches(1, start=2)) == expected[1][2:]


def test_unshuffled_is_sequential() -> None:
    sampler = EpochSampler(7, 3, shuffle=False, seed=0, drop_last=False)
    assert list(sampler.batches(4)) == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_epochs_equal_distributed_sampler(drop_last: bool) -> None:
    for rank in range(3):
        sampler = EpochSampler(
            10, 2, shuffle=True, seed=3, drop_last=drop_last, rank=rank, world_size=3
        )
        ref = DistributedSampler(
            list(range(10)), num_replicas=3, rank=rank, shuffle=True, seed=3, drop_last=drop_last
        )
        for epoch in range(2):
            ref.set_epoch(epoch)
            expected = list(BatchSampler(ref, 2, drop_last))
            assert list(sampler.batches(epoch)) == expected


def test_with_last_marks_the_final_batch() -> None:
    assert list(with_last(iter([[1], [2], [3]]), 5)) == [
        (5, [1], False),
        (6, [2], False),
        (7, [3], True),
    ]
    assert list(with_last(iter([]), 0)) == []


def test_walk_counts_the_epochs_a_read_draws_first() -> None:
    """A shuffled epoch's order follows from the ones before it (DataLoader's generator):
    reading it draws from the epoch read last, or from the seed going back; an order
    drawn on its own (seed + epoch) or none is no walk."""
    sampler = EpochSampler(23, 5, shuffle=True, seed=7, drop_last=False)
    assert sampler.walk(0) == 1 and sampler.walk(5) == 6
    list(sampler.batches(5))
    assert sampler.walk(6) == 1 and sampler.walk(9) == 4
    assert sampler.walk(5) == 6 and sampler.walk(2) == 3  # back: from the seed
    assert EpochSampler(23, 5, shuffle=False, seed=7, drop_last=False).walk(10**9) == 0
    distributed = EpochSampler(23, 5, shuffle=True, seed=7, drop_last=False, world_size=2)
    assert distributed.walk(10**9) == 0
