"""Parity with torch.utils.data.DataLoader, through a real server, for every kind.

batch_size in {1, 7, 64}, a length that is no multiple of any of them, shuffle and
drop_last on and off (drop_last only where it drops something: not at batch_size 1),
num_workers in {0, 2}, three epochs: the same batches, in the same order, with the same
dtypes and nested structure.

The reference is DataLoader without workers, computed once per configuration and shared
by both num_workers: none of these datasets draws random numbers, and DataLoader's
workers only split such a dataset's batches among them (same sampler, same generator
draws, same collate), so its batches do not depend on num_workers. DataLoader with two
workers, forked anew every epoch and handing each batch over a queue, cost three
quarters of this module's time; ``test_getitems_protocol`` still compares against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.helpers import assert_same, unique

LENGTH = 150  # 150 = 2*64 + 22 = 21*7 + 3


def _write_files(root: Path) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 255, (LENGTH, 3, 4, 4), generator=g, dtype=torch.uint8)
    y = torch.arange(LENGTH, dtype=torch.int64)
    torch.save((x, y.float()), root / "pair.pt")
    save_file({"image": x.float(), "label": y}, str(root / "pair.safetensors"))
    np.save(root / "x.npy", x.numpy().astype(np.float32))
    np.save(root / "y.npy", y.numpy())


KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "synthetic": (
        "synthetic",
        {
            "length": LENGTH,
            "seed": 3,
            "fields": [
                {"shape": [3, 4, 4], "dtype": "float32"},
                {"shape": [], "dtype": "int64", "low": 0, "high": 10},
            ],
        },
    ),
    "tensors-pt": ("tensors", {"path": "pair.pt"}),
    "tensors-safetensors": ("tensors", {"path": "pair.safetensors"}),
    "npy-tuple": ("npy", {"paths": ["x.npy", "y.npy"]}),
    "npy-dict": ("npy", {"paths": {"image": "x.npy", "label": "y.npy"}}),
    "python-mixed": (
        "python",
        {"factory": "tests.fixtures.datasets:Mixed", "kwargs": {"length": LENGTH}},
    ),
}


@pytest.fixture(scope="module")
def datasets(server: Server) -> dict[str, Any]:
    """Register every kind once; return the same Dataset objects, built locally."""
    _write_files(server.data_root)
    ctx = DatasetContext(server.data_root, ("tests.fixtures",))
    local = {}
    with server.client() as c:
        for label, (kind, params) in KINDS.items():
            name = f"parity-{label}"
            c.create_dataset(name, kind, params)
            local[label] = (name, build_dataset(kind, params, ctx))
    return local


def _reference(ds: Any, epochs: int, **kw: Any) -> list[list[Any]]:
    gen = torch.Generator().manual_seed(kw.pop("seed"))
    loader = DataLoader(ds, generator=gen, **kw)
    return [list(loader) for _ in range(epochs)]


_references: dict[tuple[Any, ...], list[list[Any]]] = {}


def _shared_reference(name: str, ds: Any, epochs: int, **kw: Any) -> list[list[Any]]:
    """``_reference`` without workers, once per dataset and configuration (see the
    module docstring)."""
    key = (name, epochs, *sorted(kw.items()))
    if key not in _references:
        _references[key] = _reference(ds, epochs, num_workers=0, **kw)
    return _references[key]


def _check(
    admin: Client,
    server: Server,
    name: str,
    ds: Any,
    *,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    num_workers: int,
    epochs: int = 3,
    reference_workers: int | None = None,
) -> None:
    """Loader ``name`` against DataLoader over ``ds``: the shared reference without
    workers, or one with ``reference_workers``."""
    loader_name = unique("parity")
    admin.create_loader(
        loader_name,
        dataset=name,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=1234,
        drop_last=drop_last,
        num_workers=num_workers,
    )
    try:
        kw = {"batch_size": batch_size, "shuffle": shuffle, "seed": 1234, "drop_last": drop_last}
        if reference_workers is None:
            want = _shared_reference(name, ds, epochs, **kw)
        else:
            want = _reference(ds, epochs, num_workers=reference_workers, **kw)
        with Loader(loader_name, socket=server.socket, copy=False) as loader:
            assert len(loader) == len(want[0])
            for epoch in range(epochs):
                got = [_own(b) for b in loader]
                assert len(got) == len(want[epoch]), f"epoch {epoch}: batch count"
                for i, (g, w) in enumerate(zip(got, want[epoch], strict=True)):
                    assert_same(g, w, f"epoch {epoch} batch {i}")
    finally:
        admin.delete_loader(loader_name)


def _own(batch: Any) -> Any:
    """Views are valid until the next batch: keep owned copies for the comparison."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _own(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_own(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_own(v) for v in batch)
    return batch


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_parity(
    datasets: dict[str, Any],
    admin: Client,
    server: Server,
    kind: str,
    batch_size: int,
    num_workers: int,
) -> None:
    name, ds = datasets[kind]
    for shuffle in (False, True):
        # drop_last at batch_size 1 drops nothing: the same configuration twice
        for drop_last in (False, True) if batch_size > 1 else (False,):
            _check(
                admin,
                server,
                name,
                ds,
                batch_size=batch_size,
                shuffle=shuffle,
                drop_last=drop_last,
                num_workers=num_workers,
            )


def test_getitems_protocol(admin: Client, server: Server) -> None:
    """Datasets with __getitems__ are fetched a batch at a time, as DataLoader does."""
    name = unique("batched")
    admin.create_dataset(name, "python", {"factory": "tests.fixtures.datasets:Batched"})
    ds = build_dataset(
        "python",
        {"factory": "tests.fixtures.datasets:Batched"},
        DatasetContext(server.data_root, ("tests.fixtures",)),
    )
    _check(
        admin,
        server,
        name,
        ds,
        batch_size=4,
        shuffle=True,
        drop_last=False,
        num_workers=2,
        reference_workers=2,  # DataLoader with workers itself
    )


def test_break_starts_next_epoch(datasets: dict[str, Any], admin: Client, server: Server) -> None:
    """Leaving a loop early and iterating again gives the next epoch, as with DataLoader."""
    name, ds = datasets["synthetic"]
    loader_name = unique("break")
    admin.create_loader(
        loader_name, dataset=name, batch_size=16, shuffle=True, seed=5, num_workers=2
    )
    want = _reference(ds, 2, batch_size=16, shuffle=True, seed=5)
    with Loader(loader_name, socket=server.socket) as loader:
        for i, batch in enumerate(loader):
            assert_same(_own(batch), want[0][i])
            if i == 2:
                break
        got = [_own(b) for b in loader]
    assert len(got) == len(want[1])
    for g, w in zip(got, want[1], strict=True):
        assert_same(g, w)
    admin.delete_loader(loader_name)


def test_epoch_iterator_is_an_iterator(
    datasets: dict[str, Any], admin: Client, server: Server
) -> None:
    """``it = iter(loader); next(it); for b in it:`` continues the same epoch, as with
    DataLoader (the iterator's ``__iter__`` is itself); an older epoch's iterator ends
    once a newer ``iter(loader)`` has started."""
    name, ds = datasets["synthetic"]
    loader_name = unique("iterator")
    admin.create_loader(loader_name, dataset=name, batch_size=16, shuffle=True, seed=7)
    want = _reference(ds, 3, batch_size=16, shuffle=True, seed=7)
    try:
        with Loader(loader_name, socket=server.socket) as loader:
            it = iter(loader)
            assert iter(it) is it and len(it) == len(want[0])
            got = [_own(next(it))]
            got += [_own(b) for b in it]  # for-loop over the iterator: the same epoch
            assert len(got) == len(want[0])
            for g, w in zip(got, want[0], strict=True):
                assert_same(g, w)
            old = iter(loader)
            assert_same(_own(next(old)), want[1][0])
            new = iter(loader)  # skips the rest of epoch 1
            assert list(old) == []
            got = [_own(b) for b in new]
            for g, w in zip(got, want[2], strict=True):
                assert_same(g, w)
            assert len(got) == len(want[2])
    finally:
        admin.delete_loader(loader_name)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_break_abandons_the_rest_of_the_epoch(
    datasets: dict[str, Any], admin: Client, server: Server, num_workers: int
) -> None:
    """After a trainer breaks out of an epoch, the server drops what it prefetched for
    that epoch's rest and starts the next one, rather than producing the rest first."""
    name, ds = datasets["synthetic"]
    loader_name = unique("abandon")
    admin.create_loader(
        loader_name, dataset=name, batch_size=1, shuffle=True, seed=9, num_workers=num_workers
    )
    want = _reference(ds, 2, batch_size=1, shuffle=True, seed=9)
    try:
        with Loader(loader_name, socket=server.socket) as loader:
            slots = loader.nslots
            for i, batch in enumerate(loader):
                assert_same(_own(batch), want[0][i])
                if i == 1:
                    break
            got = [_own(b) for b in loader]
            assert len(got) == LENGTH
            for g, w in zip(got, want[1], strict=True):
                assert_same(g, w)
            produced = admin.loader_stats(loader_name)["batches_produced"]
        # Epoch 0: the 2 taken plus at most a ring's worth; epoch 1: all of it; epoch 2:
        # at most a ring's worth prefetched. Producing epoch 0's rest would be 2 * LENGTH.
        assert produced <= LENGTH + 2 * slots + 2, produced
    finally:
        admin.delete_loader(loader_name)
