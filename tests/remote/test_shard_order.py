"""The shard-aware order (a loader's ``shard_size``): which samples each rank reads, its
batches, a mid-epoch elastic resume from 4 ranks to 3, and what a node fetches from the
store under it against DataLoader's global order, counted by the proxy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bench import references
from pinfeed import Client, InvalidRequest, Loader, merge_states
from pinfeed import elastic as el
from pinfeed_server.engine.sampler import EpochSampler
from tests.fixtures.elastic import check_once
from tests.helpers import assert_same, unique
from tests.launcher import Server
from tests.remote.conftest import remote_env
from tests.remote.data import BUCKET
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

SEQ = 127  # a window: 128 uint16 tokens (with its target), 256 bytes
BLOCK = 1 << 16  # remote_env's PINFEED_REMOTE_BLOCK_BYTES
PER_BLOCK = BLOCK // (2 * SEQ)  # windows starting in one block (stride SEQ)


def _ranks(
    length: int, world: int, k: int | None, *, drop_last: bool = False, seed: int = 5
) -> list[EpochSampler]:
    return [
        EpochSampler(
            length,
            4,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
            rank=r,
            world_size=world,
            shard_size=k,
        )
        for r in range(world)
    ]


@pytest.mark.parametrize(
    ("length", "world", "k", "drop_last"),
    [(1000, 4, 37, False), (1003, 4, 37, False), (1003, 4, 37, True), (10, 4, 3, False)],
)
def test_each_rank_reads_a_consecutive_share_of_whole_shards(
    length: int, world: int, k: int, drop_last: bool
) -> None:
    plan = el.Plan(length, True, 5, drop_last, k)
    for epoch in range(3):
        seq = el.shard_sequence(plan, epoch).tolist()
        assert sorted(seq) == list(range(length))
        runs = [s // k for s in seq]  # each shard's samples in one run
        assert len([i for i in range(len(runs)) if i == 0 or runs[i] != runs[i - 1]]) == (
            math.ceil(length / k)
        )
        shares = [s.permutation(epoch) for s in _ranks(length, world, k, drop_last=drop_last)]
        global_ = [s.permutation(epoch) for s in _ranks(length, world, None, drop_last=drop_last)]
        assert [len(s) for s in shares] == [len(s) for s in global_]  # DistributedSampler's
        at = 0
        for share in shares:
            own = [i for i in share if i in set(seq[at : at + len(share)])]
            # the block of the sequence, but for the padding (another rank's first sample)
            assert share[: len(own)] == seq[at : at + len(own)]
            assert len(share) - len(own) <= 1
            at += len(own)
            touched = {i // k for i in own}  # a partial shard at each end, and the short one
            assert len(touched) <= math.ceil(len(own) / k) + 2
        if not drop_last:
            assert set().union(*map(set, shares)) == set(range(length))
        else:
            assert sum(map(len, shares)) == len(set().union(*map(set, shares)))
    assert el.shard_sequence(plan, 0).tolist() != el.shard_sequence(plan, 1).tolist()
    same = el.Plan(length, True, 5, drop_last, k)
    assert el.shard_sequence(same, 2).tolist() == el.shard_sequence(plan, 2).tolist()


def test_a_state_saved_before_the_field_reads_as_the_global_order() -> None:
    plan = el.Plan.from_json({"length": 10, "shuffle": True, "seed": 1, "drop_last": False})
    assert plan == el.Plan(10, True, 1, False, None)
    assert el.Plan.from_json(el.Plan(10, True, 1, False, 4).to_json()) == el.Plan(
        10, True, 1, False, 4
    )


def _copy(batch: Any) -> list[torch.Tensor]:
    return [t.clone() for t in batch]


def _token_file(server: Server, name: str, blocks: int) -> str:
    """A uint16 token file of ``blocks`` store blocks under the data root; its path."""
    rng = np.random.default_rng(3)
    (server.data_root / name).parent.mkdir(parents=True, exist_ok=True)
    rng.integers(0, 50257, blocks * BLOCK // 2 + 1, dtype=np.uint16).tofile(server.data_root / name)
    return name


def test_batches_resume_and_elastic_resume_4_to_3(
    admin: Client, remote_server: Server, registered: list[str]
) -> None:
    """Four ranks (0 and 2 workers) over a local token file with ``shard_size``: each
    rank's batches are DataLoader's over the same files with the rank's order as its
    sampler; checkpointed mid-epoch and resumed at three ranks, each sample of the
    epoch once, as many batches on every new rank, and the next epoch shard-aware at
    three ranks."""
    path = _token_file(remote_server, f"{unique('so')}/t.bin", 4)
    name = unique("shardorder")
    length = admin.create_dataset(name, "tokens", {"path": path, "seq_len": SEQ})["length"]
    registered.append(name)
    params = {"path": path, "dtype": "uint16", "seq_len": SEQ}
    reference = references.tokens(remote_server.data_root, params)
    batch, seed, k = 8, 11, 50

    def loaders(world: int) -> list[str]:
        names = [unique(f"so{world}") for _ in range(world)]
        for rank, lname in enumerate(names):
            admin.create_loader(
                lname,
                dataset=name,
                batch_size=batch,
                shuffle=True,
                seed=seed,
                rank=rank,
                world_size=world,
                shard_size=k,
                num_workers=2 * (rank % 2),
            )
        return names

    def want(world: int, rank: int, epoch: int) -> list[list[torch.Tensor]]:
        order = _ranks(length, world, k, seed=seed)[rank].permutation(epoch)
        return [list(b) for b in DataLoader(reference, batch, sampler=order)]

    old, before, states = loaders(4), [], []
    try:
        for rank, lname in enumerate(old):
            with Loader(lname, socket=remote_server.socket) as loader:
                assert_same([_copy(b) for b in loader], want(4, rank, 0))
                it = iter(loader)
                got = [_copy(next(it)) for _ in range(3)]
                states.append(loader.state_dict())
                next(it)  # gone with the trainer
            assert_same(got, want(4, rank, 1)[:3])
            order = _ranks(length, 4, k, seed=seed)[rank].permutation(1)
            before.append(order[: 3 * batch])
        merged = merge_states(states)
        assert merged["plan"]["shard_size"] == k
        new = loaders(3)
        old += new
        after, counts = [], []
        for rank, lname in enumerate(new):
            with Loader(lname, socket=remote_server.socket) as loader:
                loader.load_state_dict(merged)
                rest = [_copy(b) for b in loader]
                following = [_copy(b) for b in loader]
            plan = el.Plan.from_json(merged["plan"])
            assert plan is not None
            resumed = el.resume(merged, el.Target(plan, rank, 3, batch, max(1, 2 * (rank % 2))))
            assert resumed.elastic is not None
            share = el.stage_samples(plan, resumed.elastic, 3, rank, batch).tolist()
            assert_same(rest, [list(b) for b in DataLoader(reference, batch, sampler=share)])
            assert_same(following, want(3, rank, 2))
            after.append(share)
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
        for lname in old:
            admin.delete_loader(lname)


def test_refused_where_it_cannot_apply(admin: Client, remote_server: Server) -> None:
    with pytest.raises(InvalidRequest, match="shard_size orders the samples itself"):
        admin.create_loader(
            unique("so"),
            dataset="nonexistent",
            sampler={"factory": "torch.utils.data:SequentialSampler"},
            shard_size=4,
        )


@pytest.mark.heavy  # three epochs through a store and a cache: half a minute
def test_a_node_fetches_its_share_of_the_blocks(tmp_path: Path, s3: S3Server, prefix: str) -> None:
    """Rank 0 of 4 (a node of 4) over a token file of 32 blocks in the store, three
    epochs, through a server whose object cache holds 12 blocks (a node's cache holds
    its share of a dataset, not all of it): under the shard-aware order with a block's
    windows a shard, the node fetches its quarter of the blocks an epoch and the two at
    its share's edges, plus what it fetches ahead into the fourth epoch (a quarter of
    the cache); under the global order it needs nearly every block every epoch."""
    blocks, epochs, cache = 32, 3, 12
    with (
        FaultProxy(s3.endpoint) as link,
        Server(
            tmp_path / "srv",
            env=remote_env(
                s3,
                link.endpoint,
                PINFEED_REMOTE_CACHE_MAX_BYTES=str(cache * BLOCK),
            ),
        ) as srv,
        srv.client() as admin,
    ):
        path = _token_file(srv, f"{prefix}/t.bin", blocks)
        data = (srv.data_root / path).read_bytes()
        fetched: dict[str, float] = {}
        for order, k in (("global", None), ("shard-aware", PER_BLOCK)):
            s3.put(BUCKET, f"{prefix}/{order}.bin", data)
            name = unique("sofetch")
            url = f"s3://{BUCKET}/{prefix}/{order}.bin"
            length = admin.create_dataset(name, "tokens", {"path": url, "seq_len": SEQ})["length"]
            lname = unique("sofetch")
            admin.create_loader(
                lname, dataset=name, batch_size=16, shuffle=True, seed=1, rank=0, world_size=4,
                shard_size=k, num_workers=0,
            )  # fmt: skip
            link.reset_counts()
            with Loader(lname, socket=srv.socket) as loader:
                for _ in range(epochs):
                    assert sum(len(b[0]) for b in loader) == math.ceil(length / 4)
            fetched[order] = link.counts.bytes / len(data) / epochs
            admin.delete_loader(lname)
            admin.delete_dataset(name)
    print(f"rank 0 of 4 fetched, an epoch, {fetched} of the file")  # shown with -s
    share = (blocks // 4 + 2) * epochs + cache // 4
    assert fetched["shard-aware"] <= share / blocks / epochs + 0.01
    assert fetched["global"] >= (blocks + (blocks - cache) * (epochs - 1)) / blocks / epochs
