"""Sharding with DistributedSampler semantics: every rank's loader on its own, no
coordination, equals DataLoader(sampler=DistributedSampler(...)) with set_epoch."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.helpers import assert_same, unique

PARAMS: dict[str, Any] = {
    "length": 50,
    "seed": 4,
    "fields": [{"shape": [2], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 100}],
}


@pytest.fixture(scope="module")
def dataset(server: Server) -> tuple[str, Any]:
    name = unique("dist")
    with server.client() as c:
        c.create_dataset(name, "synthetic", PARAMS)
    return name, build_dataset("synthetic", PARAMS, DatasetContext(server.data_root))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_parity(
    admin: Client,
    server: Server,
    dataset: tuple[str, Any],
    world_size: int,
    shuffle: bool,
    drop_last: bool,
) -> None:
    name, ds = dataset
    seen: list[tuple[float, ...]] = []  # samples by their (random, unique) features
    for rank in range(world_size):
        loader_name = unique("rank")
        admin.create_loader(
            loader_name,
            dataset=name,
            batch_size=4,
            shuffle=shuffle,
            seed=11,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            num_workers=2 if rank == 0 else 0,
        )
        sampler = DistributedSampler(
            ds, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
        )
        ref = DataLoader(ds, batch_size=4, sampler=sampler, drop_last=drop_last)
        with Loader(loader_name, socket=server.socket) as loader:
            assert len(loader) == len(ref)
            for epoch in range(3):
                sampler.set_epoch(epoch)
                loader.set_epoch(epoch)
                got = [[t.clone() for t in b] for b in loader]
                want = list(ref)
                assert len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    assert_same(g, w)
                if epoch == 0:
                    seen.extend(tuple(row) for w in want for row in w[0].tolist())
        admin.delete_loader(loader_name)
    if drop_last or 50 % world_size == 0:
        assert len(seen) == len(set(seen)), "ranks' shards overlap"


def test_set_epoch_can_jump(admin: Client, server: Server, dataset: tuple[str, Any]) -> None:
    """set_epoch to any epoch (forward or back) gives that epoch's batches."""
    name, ds = dataset
    loader_name = unique("jump")
    admin.create_loader(
        loader_name,
        dataset=name,
        batch_size=8,
        shuffle=True,
        seed=2,
        rank=1,
        world_size=2,
        num_workers=2,
    )
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=2)
    ref = DataLoader(ds, batch_size=8, sampler=sampler)
    with Loader(loader_name, socket=server.socket) as loader:
        for epoch in (5, 2, 2, 9):
            sampler.set_epoch(epoch)
            loader.set_epoch(epoch)
            for g, w in zip(loader, ref, strict=True):
                assert_same(list(g), w)
    admin.delete_loader(loader_name)


def test_rank_validation(admin: Client, dataset: tuple[str, Any]) -> None:
    from pinfeed import InvalidRequest

    with pytest.raises(InvalidRequest, match="rank"):
        admin.create_loader(unique("bad"), dataset=dataset[0], rank=2, world_size=2)
    with pytest.raises(InvalidRequest, match="world_size"):
        admin.create_loader(unique("bad"), dataset=dataset[0], rank=1)
