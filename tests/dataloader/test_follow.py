"""The objects follow the trainer: where torch's DataLoader hands its workers the
objects as they are at ``iter()`` (always without workers; every epoch without
persistent workers; the first with them), ``pinfeed.DataLoader`` uses them as they are
then too. ``dataset.set_epoch(e)`` (Hugging Face's IterableDataset, WebDataset,
curricula), an attribute set on the dataset, a new ``collate_fn``: each takes effect
exactly when it does under torch. Every case runs the same script with torch's
DataLoader and pinfeed's and compares the epochs batch for batch, at 0 workers, 2, and
2 persistent ones; what did not change is not shipped again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import pinfeed
from tests.conftest import Server
from tests.dataloader.test_parity import _clone as clone
from tests.helpers import assert_same

SETUPS = [
    pytest.param({"num_workers": 0}, id="nw0"),
    pytest.param({"num_workers": 2}, id="nw2"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="nw2-persistent"),
]


class Curriculum(Dataset[Any]):
    """Samples that depend on the epoch (``set_epoch``) and on an attribute (``scale``),
    and on a large table the dataset holds (shipped once, by id)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.scale = 1
        self.table = torch.arange(40_000, dtype=torch.int64)  # 320 KB: a stored buffer

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        return torch.stack([self.table[i] * self.scale, torch.tensor(1000 * self.epoch)])


class EpochStream(IterableDataset[Any]):
    """A stream reshuffled per epoch from ``set_epoch``, split across workers."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        order = torch.randperm(30, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist()[worker::workers]:
            yield torch.tensor([i, self.epoch])


def run(
    make: Callable[[Any], Any],
    dataset: Any,
    between: Callable[[Any, Any, int], None],
    epochs: int = 3,
) -> list[list[Any]]:
    """A training loop's epochs: ``between(loader, dataset, e)`` before each (what a
    trainer does then: set_epoch, a curriculum step), then every batch (cloned)."""
    torch.manual_seed(7)
    loader = make(dataset)
    out = []
    for epoch in range(epochs):
        between(loader, dataset, epoch)
        out.append([clone(b) for b in loader])
    if isinstance(loader, pinfeed.DataLoader):
        loader.close()
    return out


def both(
    server: Server,
    new: Callable[[], Any],
    between: Callable[[Any, Any, int], None],
    **kwargs: Any,
) -> tuple[list[list[Any]], list[list[Any]]]:
    theirs = run(lambda ds: TorchDataLoader(ds, **kwargs), new(), between)
    ours = run(lambda ds: pinfeed.DataLoader(ds, socket=server.socket, **kwargs), new(), between)
    return theirs, ours


def assert_epochs(theirs: list[list[Any]], ours: list[list[Any]]) -> None:
    assert len(theirs) == len(ours)
    for e, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert len(a) == len(b), f"epoch {e}"
        for x, y in zip(a, b, strict=True):
            assert_same(y, x, f"epoch {e}")


def set_epoch(loader: Any, ds: Any, epoch: int) -> None:
    ds.set_epoch(epoch)


@pytest.mark.parametrize("setup", SETUPS)
def test_set_epoch_on_a_map_style_dataset(server: Server, setup: dict[str, Any]) -> None:
    theirs, ours = both(server, Curriculum, set_epoch, batch_size=5, shuffle=True, **setup)
    assert_epochs(theirs, ours)
    if not setup.get("persistent_workers"):
        assert theirs[1][0][0][1] == 1000  # the data moved on with the epoch


@pytest.mark.parametrize("setup", SETUPS)
def test_attributes_set_after_the_loader_was_made(server: Server, setup: dict[str, Any]) -> None:
    def curriculum(loader: Any, ds: Any, epoch: int) -> None:
        ds.set_epoch(epoch)
        ds.scale = 10 ** (epoch + 1)  # set before the first epoch too: after construction
        if epoch == 2:
            ds.table = torch.arange(40_000, dtype=torch.int64) * -1  # a new large tensor

    theirs, ours = both(server, Curriculum, curriculum, batch_size=4, **setup)
    assert_epochs(theirs, ours)


@pytest.mark.parametrize("setup", SETUPS)
def test_in_place_changes_of_a_large_buffer(server: Server, setup: dict[str, Any]) -> None:
    """A torch op in place (its version moves) and a numpy write over the whole array."""

    class Arrays(Curriculum):
        def __init__(self) -> None:
            super().__init__()
            self.weights = np.ones(20_000)  # 160 KB: stored

        def __getitem__(self, i: int) -> Any:
            return torch.stack([self.table[i], torch.tensor(int(self.weights[i]))])

    def change(loader: Any, ds: Any, epoch: int) -> None:
        if epoch == 1:
            ds.table.mul_(3)
        if epoch == 2:
            ds.weights[:] = 7

    theirs, ours = both(server, Arrays, change, batch_size=6, **setup)
    assert_epochs(theirs, ours)


@pytest.mark.parametrize("setup", SETUPS)
def test_set_epoch_on_an_iterable_dataset(server: Server, setup: dict[str, Any]) -> None:
    theirs, ours = both(server, EpochStream, set_epoch, batch_size=4, **setup)
    assert_epochs(theirs, ours)


@pytest.mark.parametrize("setup", SETUPS[:2])
def test_a_new_collate_fn_between_epochs(server: Server, setup: dict[str, Any]) -> None:
    def swap(loader: Any, ds: Any, epoch: int) -> None:
        if epoch == 1:
            loader.collate_fn = lambda samples: torch.stack(samples).sum(0)

    theirs, ours = both(server, Curriculum, swap, batch_size=4, **setup)
    assert_epochs(theirs, ours)


@pytest.mark.parametrize("setup", SETUPS)
def test_hugging_face_iterable_dataset_with_shuffle_and_set_epoch(
    server: Server, setup: dict[str, Any]
) -> None:
    """What Hugging Face's Trainer and Accelerate do each epoch with a streaming dataset:
    ``set_epoch`` reseeds its shuffle buffer and shard order."""
    datasets = pytest.importorskip("datasets")

    def new() -> Any:
        table = datasets.Dataset.from_dict({"x": list(range(48)), "y": [i % 5 for i in range(48)]})
        stream = table.to_iterable_dataset(num_shards=4).shuffle(seed=42, buffer_size=4)
        return stream.with_format("torch")

    theirs, ours = both(server, new, set_epoch, batch_size=4, **setup)
    assert_epochs(theirs, ours)
    if not setup.get("persistent_workers"):
        order = [torch.cat([b["x"] for b in epoch]) for epoch in theirs]
        assert not torch.equal(order[0], order[1])  # a new order


def test_objects_that_did_not_change_are_not_shipped_again(server: Server) -> None:
    ds = Curriculum()
    loader = pinfeed.DataLoader(ds, batch_size=8, socket=server.socket)
    first = loader._owned.payload
    for _ in range(3):
        list(loader)
    assert loader._owned.shipper.whole() == first  # one payload: never shipped again
    ds.scale = 2
    list(loader)
    assert loader._owned.shipper.whole() != first
    loader.close()
