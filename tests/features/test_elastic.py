"""Elastic resume on a real server: ranks of one world size checkpoint mid-epoch, and
the ranks of another resume from their merged states with the rest of that epoch,
every sample once (beyond the stated padding or cut), as many batches on every new
rank; the elastic epoch is DataLoader's over each new rank's share (augmentations and
all, on DataLoader's worker streams), and the next epoch DistributedSampler's at the
new size. Also: a second resize in the same epoch, across a server crash; a SIGKILLed
worker in an elastic epoch; the same world size resuming each rank where it was; the
HTTP batch lookup of an elastic epoch."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from pinfeed import Client, InvalidState, Loader, merge_states
from pinfeed import elastic as el
from tests.conftest import Server
from tests.fixtures.elastic import check_resumed, distributed, indices, reference_epoch
from tests.helpers import assert_same, sigkill_worker, unique
from tests.reliability.procs import wait_for

FACTORY = "tests.fixtures.datasets:Augmented"
LENGTH = 150
BATCH = 5
SEED = 13
WORKERS = (2, 0)  # rank r's num_workers: WORKERS[r % 2]


def _dataset(admin: Client) -> str:
    name = unique("el")
    admin.create_dataset(
        name, "python", {"factory": FACTORY, "kwargs": {"length": LENGTH, "info": False}}
    )
    return name


@pytest.fixture(scope="module")
def dataset(server: Server) -> str:
    with server.client() as admin:
        return _dataset(admin)


def _loaders(
    admin: Client,
    dataset: str,
    world: int,
    *,
    batch: int = BATCH,
    drop_last: bool = False,
    seed: int = SEED,
    workers: tuple[int, int] = WORKERS,
    prefix: str = "el",
) -> list[str]:
    """One loader per rank of a ``world``-rank job (rank r: ``workers[r % 2]`` workers)."""
    prefix = unique(prefix)
    names = [f"{prefix}-{r}" for r in range(world)]
    for rank, name in enumerate(names):
        admin.create_loader(
            name,
            dataset=dataset,
            batch_size=batch,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world,
            num_workers=workers[rank % 2],
        )
    return names


def _copy(batch: Any) -> list[Any]:
    return [t.clone() for t in batch]


def _produced(admin: Client, name: str) -> bool:
    """The loader has made batches ahead (of its plain epoch 0, before any resume)."""
    return bool(admin.loader_stats(name)["batches_produced"] >= 1)


def _checkpointed(
    server: Server, names: list[str], epoch: int, k: int, lost: int = 2
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Each rank trains ``k`` batches of ``epoch``, checkpoints, trains ``lost`` more
    (gone with the trainer) and leaves; (what each had at the checkpoint, the states)."""
    before, states = [], []
    for name in names:
        with Loader(name, socket=server.socket) as loader:
            loader.set_epoch(epoch)
            it = iter(loader)
            got = [_copy(next(it)) for _ in range(k)]
            states.append(loader.state_dict())
            for _ in range(lost):
                next(it)
        before.append(indices(got))
    return before, states


def _share(state: dict[str, Any], rank: int, world: int, batch: int, streams: int) -> list[int]:
    """New rank ``rank``'s samples of the elastic epoch, from ``pinfeed.elastic``."""
    plan = el.Plan.from_json(state["plan"])
    assert plan is not None
    resumed = el.resume(state, el.Target(plan, rank, world, batch, streams))
    assert resumed.elastic is not None
    return el.stage_samples(plan, resumed.elastic, world, rank, batch).tolist()


CASES = [(3, False, 0), (6, True, 1), (6, False, 0), (3, True, 1)]


@pytest.mark.parametrize(
    ("new_world", "drop_last", "epoch"),
    CASES,
    ids=[f"4to{w}-{'drop' if d else 'pad'}-e{e}" for w, d, e in CASES],
)
def test_resize_mid_epoch_delivers_each_sample_once(
    admin: Client, server: Server, dataset: str, new_world: int, drop_last: bool, epoch: int
) -> None:
    old = _loaders(admin, dataset, 4, drop_last=drop_last)
    before, states = _checkpointed(server, old, epoch, k=3)
    merged = merge_states(states)
    new = _loaders(admin, dataset, new_world, drop_last=drop_last)
    rests = []
    for rank, name in enumerate(new):
        workers = WORKERS[rank % 2]
        # The loader made batches of its own epoch 0 before the resume: they must go.
        wait_for(lambda name=name: _produced(admin, name), "a batch made ahead")
        with Loader(name, socket=server.socket) as loader:
            loader.load_state_dict(merged)
            loader.set_epoch(epoch)  # as Lightning does after a restore: the position stays
            start = loader.state_dict()["index"]
            assert start >= 3 and start % max(1, workers) == 0
            length = len(loader)  # never short of the elastic epoch's last index
            rest = [_copy(b) for b in loader]
            assert length >= start + len(rest)
            rests.append(rest)
            if rank < 2:  # the elastic epoch is DataLoader's over this rank's share
                share = _share(merged, rank, new_world, BATCH, workers)
                want = reference_epoch(
                    share,
                    epoch,
                    batch_size=BATCH,
                    num_workers=workers,
                    seed=SEED,
                    length=LENGTH,
                    drop_last=drop_last,
                )
                assert_same(rest, want)
            following = [_copy(b) for b in loader]
            sampler = distributed(LENGTH, new_world, rank, SEED, drop_last)
            if rank < 2:  # the next epoch: DistributedSampler(new_world)'s, batch for batch
                want = reference_epoch(
                    sampler,
                    epoch + 1,
                    batch_size=BATCH,
                    num_workers=workers,
                    seed=SEED,
                    length=LENGTH,
                    drop_last=drop_last,
                )
                assert_same(following, want)
            else:
                sampler.set_epoch(epoch + 1)
                order = list(sampler)
                if drop_last:
                    order = order[: len(order) // BATCH * BATCH]
                assert indices(following) == order
    check_resumed(before, rests, length=LENGTH, batch=BATCH, drop_last=drop_last)
    for name in old + new:
        admin.delete_loader(name)


def test_same_world_resumes_each_rank_where_it_was(
    admin: Client, server: Server, dataset: str
) -> None:
    names = _loaders(admin, dataset, 4)
    positions = [2, 3, 2, 4]
    states = []
    for rank, name in enumerate(names):
        with Loader(name, socket=server.socket) as loader:
            it = iter(loader)
            for _ in range(positions[rank]):
                next(it)
            states.append(loader.state_dict())
    merged = merge_states(states)
    for rank, name in enumerate(names):
        with Loader(name, socket=server.socket) as loader:
            loader.load_state_dict(merged)  # every rank loads the one state
            assert loader.state_dict()["index"] == positions[rank]
            rest = [_copy(b) for b in loader]
        want = reference_epoch(
            distributed(LENGTH, 4, rank, SEED, False),
            0,
            batch_size=BATCH,
            num_workers=WORKERS[rank % 2],
            seed=SEED,
            length=LENGTH,
        )
        assert_same(rest, want[positions[rank] :])
        other = Loader(names[(rank + 1) % 4], socket=server.socket)
        with other, pytest.raises(InvalidState, match="not rank"):
            other.load_state_dict(states[rank])  # one rank's own state: that rank's alone
    for name in names:
        admin.delete_loader(name)


def test_a_worker_killed_in_an_elastic_epoch(admin: Client, server: Server, dataset: str) -> None:
    """The replaced worker replays its stream of the elastic epoch: the batches are
    still DataLoader's over the share."""
    _, states = _checkpointed(server, _loaders(admin, dataset, 4), 0, k=2, lost=0)
    merged = merge_states(states)
    (name,) = _loaders(admin, dataset, 1)  # world_size 1, 2 workers
    with Loader(name, socket=server.socket) as loader:
        loader.load_state_dict(merged)
        it = iter(loader)
        got = [_copy(next(it)) for _ in range(3)]
        sigkill_worker(admin, server, name, 2, 1)
        got += [_copy(b) for b in it]
    share = _share(merged, 0, 1, BATCH, 2)
    want = reference_epoch(share, 0, batch_size=BATCH, num_workers=2, seed=SEED, length=LENGTH)
    assert_same(got, want)
    admin.delete_loader(name)


def test_the_batch_lookup_of_an_elastic_epoch(admin: Client, server: Server, dataset: str) -> None:
    _, states = _checkpointed(server, _loaders(admin, dataset, 2), 0, k=4, lost=0)
    merged = merge_states(states)
    new = _loaders(admin, dataset, 3)
    with Loader(new[1], socket=server.socket) as loader:
        loader.load_state_dict(merged)
        start = loader.state_dict()["index"]
        got = [_copy(b) for b in loader]
    for j, batch in enumerate(got):
        info = admin.batch(new[1], 0, start + j)
        assert info["indices"] == batch[3].tolist()
        assert info["elastic"] is True and info["rank"] == 1 and info["worker"] is None
    info = admin.batch(new[1], 1, 0)  # the next epoch: DistributedSampler's
    assert info["elastic"] is False
    with pytest.raises(Exception, match="no batch"):
        admin.batch(new[1], 0, 0)  # consumed before the resize: not this loader's


@pytest.mark.slow
def test_a_second_resize_in_the_epoch_across_a_server_crash(restartable: Server) -> None:
    srv = restartable  # its worker cap is 64
    with srv.client() as admin:
        ds = _dataset(admin)
        before, states = _checkpointed(srv, _loaders(admin, ds, 4), 0, k=2)
        first = merge_states(states)
        middle = _loaders(admin, ds, 6, batch=4)  # resized, and a new batch size
    stage: list[list[int]] = []
    states = []
    for name in middle:
        with Loader(name, socket=srv.socket) as loader:
            loader.load_state_dict(first)
            it = iter(loader)
            stage.append(indices([_copy(next(it)) for _ in range(2)]))
            states.append(loader.state_dict())
    # The server dies; its registry keeps the loaders and their elastic epochs.
    assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
    srv.start()
    # Rank 0 goes on (its own state, the same world): one more batch of its share.
    with Loader(middle[0], socket=srv.socket) as loader:
        loader.load_state_dict(states[0])
        one = _copy(next(iter(loader)))
        share = _share(first, 0, 6, 4, WORKERS[0])
        want = reference_epoch(
            share, 0, batch_size=4, num_workers=WORKERS[0], seed=SEED, length=LENGTH
        )
        assert_same(one, want[2])
        stage[0] += one[3].tolist()
        states[0] = loader.state_dict()
    second = merge_states(states)
    with srv.client() as admin:
        last = _loaders(admin, ds, 3)
    rests = []
    for name in last:
        with Loader(name, socket=srv.socket) as loader:
            loader.load_state_dict(second)
            state = loader.state_dict()
            assert len(state["elastic"]["stages"]) == 2
            rests.append([_copy(b) for b in loader])
    check_resumed(before + stage, rests, length=LENGTH, batch=BATCH, new_world=6 + 3)
