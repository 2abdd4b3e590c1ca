"""When an epoch starts: at an iterator's first ``next()``, not at ``iter()``.

Lightning probes a loader with ``iter()`` and discards the iterator, then calls
``sampler.set_epoch`` after making the real iterator: neither may shift the epochs.
Every epoch here is checked batch for batch against DataLoader's epoch with the same
index (``DataLoader(shuffle=True, generator=Generator().manual_seed(seed))`` iterated
once per epoch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.helpers import unique

PARAMS: dict[str, Any] = {
    "length": 20,
    "seed": 6,
    "fields": [{"shape": [2], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 9}],
}
SEED = 13
EPOCHS = 4


@pytest.fixture(scope="module")
def want(server: Server) -> list[list[list[torch.Tensor]]]:
    """DataLoader's epochs 0..EPOCHS-1 (batch size 4, shuffled)."""
    ds = build_dataset("synthetic", PARAMS, DatasetContext(server.data_root))
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    return [[list(b) for b in dl] for _ in range(EPOCHS)]


@pytest.fixture()
def loader(admin: Client, server: Server) -> Any:
    ds = unique("ep")
    admin.create_dataset(ds, "synthetic", PARAMS)
    name = unique("ep")
    admin.create_loader(name, dataset=ds, batch_size=4, shuffle=True, seed=SEED)
    with Loader(name, socket=server.socket, copy=True) as loader:
        yield loader
    admin.delete_loader(name)


def _same(got: list[Any], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_an_unconsumed_iterator_starts_no_epoch(loader: Loader, want: Any) -> None:
    iter(loader)  # Lightning's probe
    iter(loader)
    _same(list(loader), want[0])
    it = iter(loader)  # made, then a newer one: the older one ends without a batch
    _same(list(loader), want[1])
    assert list(it) == []
    _same(list(loader), want[2])


def test_set_epoch_before_the_first_next_applies_to_that_iterator(
    loader: Loader, want: Any
) -> None:
    it = iter(loader)
    loader.set_epoch(2)  # after iter(), before next(): as Lightning's fit loop does
    _same(list(it), want[2])
    loader.sampler.set_epoch(1)  # Lightning's and Accelerate's call
    _same(list(loader), want[1])
    it = iter(loader)
    next(it)
    loader.set_epoch(3)  # after the first next(): the next iterator's
    _same(list(it), want[2][1:])  # after epoch 1 comes epoch 2
    _same(list(loader), want[3])


def test_set_epoch_after_load_state_dict_keeps_the_loaded_position(
    loader: Loader, want: Any
) -> None:
    it = iter(loader)
    loader.set_epoch(1)
    first = [next(it), next(it)]
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["index"] == 2
    next(it)
    iter(loader)  # a probe between restore and use changes nothing
    loader.load_state_dict(state)
    it = iter(loader)
    loader.sampler.set_epoch(1)  # the restored epoch: keep the position
    _same(first + list(it), want[1])
    loader.load_state_dict(state)
    loader.set_epoch(3)  # another epoch: start it from its first batch
    _same(list(loader), want[3])


def test_a_broken_off_epoch_restarts_with_set_epoch(loader: Loader, want: Any) -> None:
    """Lightning's sanity check breaks off validation after a few batches, then calls
    ``set_epoch(0)`` and iterates epoch 0 in full."""
    for i, _ in enumerate(loader):
        if i == 1:
            break
    loader.set_epoch(0)
    _same(list(loader), want[0])
