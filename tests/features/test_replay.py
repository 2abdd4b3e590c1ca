"""``Loader.replay(epoch, index)`` and ``GET /v1/loaders/{name}/batches/{epoch}/{index}``:
the very batch the trainer got, made again (augmentations on DataLoader's worker
streams, the ``collate_fn``), for a batch of the epoch being iterated (which goes on
undisturbed), of a past epoch, of an elastic epoch, and of a run before a server
restart; the lookup's indices are the batch's."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pinfeed import Client, InvalidPosition, Loader, merge_states
from tests.conftest import Server
from tests.features.test_elastic import _checkpointed, _dataset, _loaders
from tests.helpers import assert_same, unique

FACTORY = "tests.fixtures.datasets:Augmented"
SEED = 5


def _loader(admin: Client, dataset: str, num_workers: int, **kw: Any) -> str:
    name = unique("rep")
    admin.create_loader(
        name, dataset=dataset, batch_size=4, shuffle=True, seed=SEED, num_workers=num_workers, **kw
    )
    return name


def _copy(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: v.clone() for k, v in batch.items()}
    return [t.clone() for t in batch]


def _index(batch: Any) -> list[int]:
    return (batch["index"] if isinstance(batch, dict) else batch[3]).tolist()


@pytest.fixture(scope="module")
def dataset(server: Server) -> str:
    with server.client() as admin:
        name = unique("rep")
        admin.create_dataset(
            name, "python", {"factory": FACTORY, "kwargs": {"length": 30, "info": False}}
        )
        return name


CASES = [
    {"num_workers": 2},
    {"num_workers": 0},
    {"num_workers": 2, "persistent_workers": True},
    {"num_workers": 2, "collate_fn": "tests.fixtures.collate:jitter_collate"},
]


@pytest.mark.parametrize("config", CASES, ids=["workers", "inline", "persistent", "collate_fn"])
def test_replay_is_the_batch_the_trainer_got(
    admin: Client, server: Server, dataset: str, config: dict[str, Any]
) -> None:
    name = _loader(admin, dataset, **config)
    with Loader(name, socket=server.socket) as loader:
        past = [_copy(b) for b in loader]  # epoch 0 (8 batches)
        it = iter(loader)  # epoch 1
        now = [_copy(next(it)) for _ in range(5)]
        # Mid-epoch: a batch of this epoch, one of the last, and one not yet made.
        for epoch, index, want in ((1, 3, now[3]), (0, 6, past[6]), (0, 0, past[0])):
            got = loader.replay(epoch, index)
            assert_same(got, want, f"replay of {epoch}/{index}")
            info = admin.batch(name, epoch, index)
            assert info["indices"] == _index(want)
            workers = config["num_workers"]
            assert info["worker"] == (index % workers if workers else None)
        ahead = loader.replay(1, 7)
        now += [_copy(b) for b in it]  # the running epoch, undisturbed
        assert len(now) == 8
        assert_same(ahead, now[7])
        with pytest.raises(InvalidPosition, match="no batch 8"):
            loader.replay(1, 8)
    with Loader(name, socket=server.socket) as fresh:  # epoch 1 again, from its start
        fresh.set_epoch(1)
        assert_same([_copy(b) for b in fresh], now)
    admin.delete_loader(name)


def test_replay_of_an_elastic_epoch(admin: Client, server: Server) -> None:
    ds = _dataset(admin)
    old = _loaders(admin, ds, 4)
    _, states = _checkpointed(server, old, 0, k=3)
    names = _loaders(admin, ds, 3)
    with Loader(names[0], socket=server.socket) as loader:
        loader.load_state_dict(merge_states(states))
        start = loader.state_dict()["index"]
        got = [_copy(b) for b in loader]
        for j in (0, len(got) - 1):
            assert_same(loader.replay(0, start + j), got[j])
        with pytest.raises(InvalidPosition, match="no batch 0"):
            loader.replay(0, 0)  # consumed before the resize, by the old ranks
    for name in old + names:
        admin.delete_loader(name)


@pytest.mark.slow
def test_replay_after_a_server_restart(restartable: Server) -> None:
    srv = restartable
    with srv.client() as admin:
        ds = unique("rep")
        params = {"factory": FACTORY, "kwargs": {"length": 30, "info": False}}
        admin.create_dataset(ds, "python", params)
        name = _loader(admin, ds, 2)
    with Loader(name, socket=srv.socket) as loader:
        seen = [[_copy(b) for b in loader] for _ in range(2)]
    srv.stop()
    srv.start()  # a new server: the loader from the registry, nothing made yet
    with Loader(name, socket=srv.socket) as loader:
        for epoch, index in ((0, 2), (1, 7), (1, 0)):
            assert_same(loader.replay(epoch, index), seen[epoch][index])
        with srv.client() as admin:
            assert admin.batch(name, 1, 5)["indices"] == _index(seen[1][5])


def test_an_iterable_has_nothing_to_replay(admin: Client, server: Server) -> None:
    ds, name = unique("rep"), unique("rep")
    admin.create_dataset(ds, "python", {"factory": "tests.fixtures.iterables:Shards"})
    admin.create_loader(name, dataset=ds, batch_size=2)
    with (
        Loader(name, socket=server.socket) as loader,
        pytest.raises(InvalidPosition, match="IterableDataset"),
    ):
        loader.replay(0, 0)
    with pytest.raises(Exception, match="no sample indices"):
        admin.batch(name, 0, 0)
    admin.delete_loader(name)


def test_a_lookup_too_far_to_draw_is_refused_at_once(
    admin: Client, server: Server, dataset: str
) -> None:
    """A shuffled loader's epoch 2**31 - 1 is a valid path, but its order follows from
    every epoch before it: the server refuses it (404, saying how to get there) instead of
    drawing for hours on an HTTP thread; epochs within reach still answer, the same
    whichever way they are reached."""
    name = _loader(admin, dataset, 0)
    far = httpx.get(
        f"{server.url}/v1/loaders/{name}/batches/{2**31 - 1}/0",
        timeout=30,  # the unbounded walk: a ReadTimeout here
    )
    assert far.status_code == 404, far.text
    assert far.headers["content-type"] == "application/problem+json"
    assert "look up epochs on the way first" in far.json()["detail"]
    ahead = admin.batch(name, 40, 3)["indices"]
    assert admin.batch(name, 2, 1)["indices"] != ahead  # back to epoch 2: from the seed
    assert admin.batch(name, 40, 3)["indices"] == ahead
    admin.delete_loader(name)
