"""Every file-backed kind over the store gives DataLoader's batches over the local files:
W1's ``.pt``, W2's ``.npy``, W3's JPEG folder, W6's token file, W7's ``save_to_disk``
folder and Parquet files, W8's shards (``data.py``), at ``num_workers`` 0 and 2 over 2
epochs; a mid-epoch resume and an elastic resume from 4 ranks to 3 over remote data."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bench.references import MemmapArrays
from pinfeed import Client, InvalidRequest, Loader, merge_states
from pinfeed import elastic as el
from tests.datasets.parity import check_parity
from tests.fixtures.elastic import check_once, distributed
from tests.helpers import assert_same, unique
from tests.launcher import Server
from tests.remote.data import BUCKET, Workload
from tests.remote.s3server import S3Server

KEYS = [
    *("W1", "W2", "W3", "W6", "W7", "W7-parquet"),
    # webdataset's gopen leaves shard files for the garbage collector to close
    pytest.param("W8", marks=pytest.mark.filterwarnings("ignore::ResourceWarning")),
]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("key", KEYS)
def test_same_batches_as_over_the_local_files(
    admin: Client,
    remote_server: Server,
    workloads: dict[str, Workload],
    registered: list[str],
    key: str,
    num_workers: int,
) -> None:
    w = workloads[key]
    name = unique(f"r{key.lower()}")
    info = admin.create_dataset(name, w.kind, w.remote)
    registered.append(name)
    local = unique(f"l{key.lower()}")
    assert admin.create_dataset(local, w.kind, w.local)["length"] == info["length"]
    registered.append(local)
    before = _reads(remote_server)
    check_parity(
        admin,
        remote_server,
        name,
        w.reference(),
        batch_size=7,
        shuffle=w.shuffle,
        num_workers=num_workers,
    )
    if w.kind != "webdataset":  # an iterable's shards are read by its workers, ungated
        assert _reads(remote_server) > before  # its batches were gated on the store's units


def _reads(server: Server) -> float:
    store = httpx.get(server.url + "/v1/node").json()["remote"]["store"]
    return float(store["hits"] + store["misses"])


def test_an_array_in_fortran_order_is_refused_saying_how_to_store_it(
    admin: Client, remote_server: Server, s3: S3Server, prefix: str
) -> None:
    path = remote_server.data_root / f"{prefix}-f.npy"
    np.save(path, np.asfortranarray(np.zeros((4, 3), dtype=np.float32)))
    s3.put(BUCKET, f"{prefix}/f.npy", path.read_bytes())
    with pytest.raises(InvalidRequest, match=r"Fortran order.*C order"):
        admin.create_dataset(unique("rf"), "npy", {"paths": [f"s3://{BUCKET}/{prefix}/f.npy"]})


def _copy(batch: Any) -> list[torch.Tensor]:
    return [t.clone() for t in batch]


def test_mid_epoch_resume(
    admin: Client, remote_server: Server, workloads: dict[str, Workload], registered: list[str]
) -> None:
    """After 5 batches of epoch 1, a new loader that loads the state gets batch 5 on:
    DataLoader's epoch 1 over the local files."""
    w = workloads["W2"]
    name = unique("rresume")
    admin.create_dataset(name, w.kind, w.remote)
    registered.append(name)
    dl = DataLoader(
        w.reference(), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(4)
    )
    want = [list(b) for _ in range(2) for b in dl]
    loaders = [unique("rresume-l") for _ in range(2)]
    for lname, nw in zip(loaders, (2, 0), strict=True):
        admin.create_loader(lname, dataset=name, batch_size=6, shuffle=True, seed=4, num_workers=nw)
    try:
        with Loader(loaders[0], socket=remote_server.socket) as loader:
            got = [_copy(b) for b in loader]
            it = iter(loader)
            got += [_copy(next(it)) for _ in range(5)]
            state = loader.state_dict()
            next(it)  # consumed, not checkpointed: it comes again
        assert (state["epoch"], state["index"]) == (1, 5)
        with Loader(loaders[1], socket=remote_server.socket) as loader:
            loader.load_state_dict(state)
            got += [_copy(b) for b in loader]
        assert_same(got, want)
    finally:
        for lname in loaders:
            admin.delete_loader(lname)


def test_elastic_resume_4_to_3_ranks(
    admin: Client, remote_server: Server, s3: S3Server, prefix: str, registered: list[str]
) -> None:
    """Four ranks checkpoint mid-epoch over an ``.npy`` pair in the store (the second
    array the sample's index); three resume from their merged states: each sample once,
    each new rank's rest DataLoader's over its share of the local files, and the next
    epoch DistributedSampler(3)'s."""
    length, batch, seed = 150, 5, 13
    rng = np.random.default_rng(9)
    root = remote_server.data_root / prefix
    root.mkdir()
    np.save(root / "x.npy", rng.random((length, 4, 4), dtype=np.float32))
    np.save(root / "i.npy", np.arange(length, dtype=np.int64))
    s3.upload(BUCKET, prefix, root)
    name = unique("relastic")
    admin.create_dataset(
        name, "npy", {"paths": [f"s3://{BUCKET}/{prefix}/x.npy", f"s3://{BUCKET}/{prefix}/i.npy"]}
    )
    registered.append(name)
    reference = MemmapArrays([root / "x.npy", root / "i.npy"])

    def loaders(world: int) -> list[str]:
        names = [unique(f"relastic{world}") for _ in range(world)]
        for rank, lname in enumerate(names):
            admin.create_loader(
                lname,
                dataset=name,
                batch_size=batch,
                shuffle=True,
                seed=seed,
                rank=rank,
                world_size=world,
                num_workers=2 * (rank % 2),
            )
        return names

    old, before, states = loaders(4), [], []
    for lname in old:
        with Loader(lname, socket=remote_server.socket) as loader:
            it = iter(loader)
            got = [_copy(next(it)) for _ in range(3)]
            states.append(loader.state_dict())
            next(it)  # gone with the trainer
        before.append([i for b in got for i in b[1].tolist()])
    merged = merge_states(states)
    new = loaders(3)
    after, counts = [], []
    try:
        for rank, lname in enumerate(new):
            with Loader(lname, socket=remote_server.socket) as loader:
                loader.load_state_dict(merged)
                rest = [_copy(b) for b in loader]
                following = [_copy(b) for b in loader]
            plan = el.Plan.from_json(merged["plan"])
            assert plan is not None
            workers = 2 * (rank % 2)
            resumed = el.resume(merged, el.Target(plan, rank, 3, batch, max(1, workers)))
            assert resumed.elastic is not None
            share = el.stage_samples(plan, resumed.elastic, 3, rank, batch).tolist()
            assert_same(rest, [list(b) for b in DataLoader(reference, batch, sampler=share)])
            sampler = distributed(length, 3, rank, seed, False)
            sampler.set_epoch(1)
            want = [list(b) for b in DataLoader(reference, batch, sampler=sampler)]
            assert_same(following, want)
            after.append([i for b in rest for i in b[1].tolist()])
            counts.append(len(rest))
        check_once(
            before,
            after,
            counts,
            length=length,
            old_world=4,
            old_batch=batch,
            new_world=3,
            new_batch=batch,
            drop_last=False,
        )
    finally:
        for lname in old + new:
            admin.delete_loader(lname)
