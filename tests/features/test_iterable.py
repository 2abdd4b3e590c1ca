"""``IterableDataset``: DataLoader's semantics, checked against a real DataLoader.

Every worker iterates its own copy, splits the shards with ``get_worker_info()``,
batches come from the workers round-robin and a worker that runs out drops out,
``drop_last`` applies per worker, each epoch is a new iterator; randomness inside
``__iter__`` and in every sample is DataLoader's (same generator seed). At
``num_workers=0`` pinfeed is DataLoader's one non-persistent worker (the loader's own
RNGs), which is what the reference uses there."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, InvalidRequest, Loader
from tests.conftest import Server
from tests.fixtures.iterables import SIZES, Shards, Unsized
from tests.helpers import assert_epochs_same, unique

BATCH = 3
SEED = 17


def _reference(epochs: int, num_workers: int, dataset: Any = None, **kw: Any) -> list[list[Any]]:
    with warnings.catch_warnings():
        # 3 workers on a 2-core machine: DataLoader's advice, not a problem here.
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        dl = DataLoader(
            Shards() if dataset is None else dataset,
            batch_size=BATCH,
            num_workers=max(1, num_workers),  # 0: the loader's own RNGs, = 1 worker
            generator=torch.Generator().manual_seed(SEED),
            **kw,
        )
        return [list(dl) for _ in range(epochs)]


def _dataset(admin: Client, factory: str = "Shards", **kwargs: Any) -> str:
    name = unique("iter")
    admin.create_dataset(
        name, "python", {"factory": f"tests.fixtures.iterables:{factory}", "kwargs": kwargs}
    )
    return name


def _loader(admin: Client, num_workers: int, dataset: str | None = None, **kw: Any) -> str:
    name = unique("iter")
    admin.create_loader(
        name,
        dataset=dataset or _dataset(admin),
        batch_size=kw.pop("batch_size", BATCH),
        seed=SEED,
        num_workers=num_workers,
        **kw,
    )
    return name


def _copy(batch: Any) -> Any:
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in batch]


def _epoch(loader: Any) -> list[Any]:
    return [_copy(b) for b in loader]


_check = assert_epochs_same


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (3, False), (2, True), (3, True)]
)
def test_batches_equal_dataloader(
    admin: Client, server: Server, num_workers: int, persistent: bool
) -> None:
    want = _reference(2, num_workers, persistent_workers=persistent)
    # The workers run out at different turns: some turns yield nothing.
    assert len(want[0]) == 10
    name = _loader(admin, num_workers, persistent_workers=persistent)
    with Loader(name, socket=server.socket) as loader:
        got = [_epoch(loader) for _ in range(2)]
    _check(got, want)
    assert not torch.equal(got[0][0][1], got[1][0][1])  # each epoch is seeded afresh
    admin.delete_loader(name)


@pytest.mark.parametrize("num_workers", [0, 3])
def test_drop_last_applies_per_worker(admin: Client, server: Server, num_workers: int) -> None:
    want = _reference(2, num_workers, drop_last=True)
    name = _loader(admin, num_workers, drop_last=True)
    with Loader(name, socket=server.socket) as loader:
        assert len(loader) == sum(SIZES) // BATCH  # DataLoader's len(): the dataset's, floored
        got = [_epoch(loader) for _ in range(2)]
    _check(got, want)
    assert all(len(b[0]) == BATCH for e in got for b in e)
    admin.delete_loader(name)


def test_len_is_dataloaders(admin: Client, server: Server) -> None:
    sized = _loader(admin, 2)
    assert admin.loader(sized)["batches_per_epoch"] == len(_reference_loader(Shards()))
    unsized = _loader(admin, 2, dataset=_dataset(admin, "Unsized"))
    assert admin.loader(unsized)["batches_per_epoch"] is None
    with Loader(unsized, socket=server.socket) as loader:
        with pytest.raises(TypeError, match="no len"):
            len(loader)
        with pytest.raises(TypeError, match="no len"):
            len(loader.dataset)
        got = _epoch(loader)
    with Loader(sized, socket=server.socket) as loader:
        assert len(loader) == 10
        assert len(loader.dataset) == sum(SIZES)
        with pytest.raises(TypeError, match="no len"):
            len(loader.sampler)
    _check([got], _reference(1, 2, Unsized()))
    admin.delete_loader(sized)
    admin.delete_loader(unsized)


def _reference_loader(dataset: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=BATCH)


@pytest.mark.parametrize(
    "fields",
    [
        {"shuffle": True},
        {"sampler": {"factory": "tests.fixtures.samplers:weighted"}},
        {"batch_sampler": {"factory": "tests.fixtures.samplers:weighted"}, "batch_size": 1},
    ],
)
def test_sampler_options_are_dataloaders_422(admin: Client, fields: dict[str, Any]) -> None:
    option = next(iter(fields))
    value = fields[option]
    try:  # DataLoader's own refusal, to compare wording
        DataLoader(Shards(), **{option: True if option == "shuffle" else [0]})
    except ValueError as exc:
        reason = str(exc).split(", but got")[0]
    ds = _dataset(admin)
    with pytest.raises(InvalidRequest, match=reason) as info:
        admin.create_loader(unique("iter"), dataset=ds, **fields)
    if option != "shuffle":
        assert value["factory"] in str(info.value)
    admin.delete_dataset(ds)  # nothing was created that uses it


def test_an_empty_iterable_is_422(admin: Client) -> None:
    ds = _dataset(admin, "Empty")
    with pytest.raises(InvalidRequest, match="yielded no sample"):
        admin.create_loader(unique("iter"), dataset=ds, batch_size=2)
    admin.delete_dataset(ds)
