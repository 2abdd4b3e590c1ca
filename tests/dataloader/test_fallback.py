"""Fallback, never a break: where pinfeed cannot serve a loader with DataLoader's
semantics (an object that cannot leave the trainer's process, a module the server
cannot import, no server), ``pinfeed.DataLoader`` runs torch's own DataLoader in the
trainer, with one ``FallbackWarning`` naming the reason; ``strict=True`` (or
``PINFEED_STRICT=1``) raises instead. And torch's signature, exactly: ``DataLoader[T]``,
more workers than the node runs (its RNG streams kept: torch's batches, torch's
warnings)."""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import pinfeed
from pinfeed import FallbackWarning, InvalidRequest, LoaderFailed, Unshippable
from tests.conftest import Server
from tests.dataloader.test_errors import installed_elsewhere as installed_elsewhere
from tests.dataloader.test_parity import Augmented, Squares, _seed
from tests.dataloader.test_parity import _clone as clone
from tests.helpers import assert_same

WORKERS = [0, 2]


class Counted(Dataset[Any]):
    """Counts its reads in a ``multiprocessing.Value`` that DataLoader's forked workers
    share with the trainer (which cannot be shipped: it lives by inheritance)."""

    def __init__(self) -> None:
        self.reads = multiprocessing.Value("i", 0)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        with self.reads.get_lock():
            self.reads.value += 1
        return torch.tensor([i, i * 3])


def epochs(loader: Any, n: int = 2) -> list[list[Any]]:
    out = [[clone(b) for b in loader] for _ in range(n)]
    if isinstance(loader, pinfeed.DataLoader):
        loader.close()
    return out


def assert_epochs(theirs: list[list[Any]], ours: list[list[Any]]) -> None:
    assert [len(e) for e in theirs] == [len(e) for e in ours]
    for a, b in zip(theirs, ours, strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(y, x)


def fallback(make: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    """``make()``'s loader and the FallbackWarnings it gave (others raise, as ever)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("error")
        warnings.simplefilter("always", FallbackWarning)
        loader = make()
    return loader, [w for w in seen if issubclass(w.category, FallbackWarning)]


@pytest.mark.parametrize("workers", WORKERS)
def test_a_dataset_holding_a_multiprocessing_value(server: Server, workers: int) -> None:
    torch.manual_seed(3)
    theirs = epochs(TorchDataLoader(Counted(), batch_size=4, shuffle=True, num_workers=workers))
    torch.manual_seed(3)
    ds = Counted()
    loader, warned = fallback(
        lambda: pinfeed.DataLoader(
            ds, batch_size=4, shuffle=True, num_workers=workers, socket=server.socket
        )
    )
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert "torch's own DataLoader" in message and "dataset.reads" in message
    assert "strict=True" in message
    assert loader.fell_back is not None and loader.fell_back.startswith("Unshippable")
    assert loader.pinfeed_name is None
    ours = epochs(loader)
    assert_epochs(theirs, ours)
    assert ds.reads.value == 40  # its reads, in the trainer's processes: shared as torch's
    with pytest.raises(Unshippable, match=r"dataset\.reads"):
        pinfeed.DataLoader(Counted(), batch_size=4, socket=server.socket, strict=True)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_module_the_server_cannot_import(
    server: Server,
    installed_elsewhere: Any,
    workers: int,
) -> None:
    theirs = epochs(TorchDataLoader(installed_elsewhere.Scans(), batch_size=2, num_workers=workers))
    loader, warned = fallback(
        lambda: pinfeed.DataLoader(
            installed_elsewhere.Scans(), batch_size=2, num_workers=workers, socket=server.socket
        )
    )
    assert len(warned) == 1 and "labdata_pf" in str(warned[0].message)
    assert_epochs(theirs, epochs(loader))
    # Without workers the server loads the objects when the loader is made; with them,
    # the process its workers fork from does, and the loader fails to start.
    error = InvalidRequest if workers == 0 else LoaderFailed
    with pytest.raises(error, match="labdata_pf"):
        pinfeed.DataLoader(
            installed_elsewhere.Scans(),
            batch_size=2,
            num_workers=workers,
            socket=server.socket,
            strict=True,
        )


def test_pinfeed_strict_in_the_environment(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINFEED_STRICT", "1")
    with pytest.raises(Unshippable):
        pinfeed.DataLoader(Counted(), socket=server.socket)
    with pytest.warns(FallbackWarning):  # strict=False wins
        loader = pinfeed.DataLoader(Counted(), socket=server.socket, strict=False)
    assert loader.fell_back is not None
    loader.close()


def test_no_server_and_no_autostart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINFEED_AUTOSTART", "0")
    socket = tmp_path / "none.sock"
    theirs = epochs(TorchDataLoader(Squares(), batch_size=5))
    loader, warned = fallback(lambda: pinfeed.DataLoader(Squares(), batch_size=5, socket=socket))
    assert len(warned) == 1 and "pinfeed serve" in str(warned[0].message)
    assert_epochs(theirs, epochs(loader))


def test_objects_that_become_unshippable_at_a_later_epoch(server: Server) -> None:
    """The epoch whose objects cannot go runs as torch's, and so do the ones after."""

    def run(make: Callable[[Any], Any]) -> list[list[Any]]:
        _seed()
        ds = Augmented()
        loader = make(ds)
        out = [[clone(b) for b in loader]]
        ds.lock = multiprocessing.Lock()  # from now on it cannot be pickled
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", FallbackWarning)
            out += [[clone(b) for b in loader] for _ in range(2)]
        if isinstance(loader, pinfeed.DataLoader):
            assert [w.category for w in seen] == [FallbackWarning]
            assert loader.fell_back is not None and "dataset.lock" in loader.fell_back
        return out

    theirs = run(lambda ds: TorchDataLoader(ds, batch_size=8, shuffle=True))
    ours = run(lambda ds: pinfeed.DataLoader(ds, batch_size=8, shuffle=True, socket=server.socket))
    assert_epochs(theirs, ours)


def test_dataloader_is_generic_as_torchs() -> None:
    alias = pinfeed.DataLoader[int]
    assert alias.__origin__ is pinfeed.DataLoader  # type: ignore[attr-defined]
    assert issubclass(pinfeed.DataLoader, TorchDataLoader)


@pytest.fixture()
def two_workers_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(tmp_path_factory.mktemp("small"), env={"PINFEED_MAX_WORKERS": "2"}) as srv:
        yield srv


def test_more_workers_than_the_node_runs(two_workers_node: Server) -> None:
    """num_workers=5 on a node of 2 worker processes: the loader runs 2 that serve
    DataLoader's 5 workers' RNG streams, so the batches are ``num_workers=5``'s; torch's
    own warnings are given, as torch gives them, and nothing falls back."""

    def run(cls: Any, **extra: Any) -> tuple[list[list[Any]], list[str]]:
        _seed()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loader = cls(Augmented(), batch_size=4, shuffle=True, num_workers=5, **extra)
            out = epochs(loader)
        return out, [str(w.message) for w in seen]

    theirs, their_warnings = run(TorchDataLoader)
    ours, our_warnings = run(pinfeed.DataLoader, socket=two_workers_node.socket)
    assert_epochs(theirs, ours)
    assert our_warnings == their_warnings
