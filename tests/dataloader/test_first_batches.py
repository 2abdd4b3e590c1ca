"""Nothing of the script's runs before DataLoader would run it: ``pinfeed.DataLoader``
reads no sample when it is made, and its loader's ring is sized from the first batches
made in the loop, in its workers where it has them. So every exception of
``__getitem__``, ``__iter__`` or ``collate_fn`` reaches the loop at the batch where
torch's reaches it, as the user's own exception type; a dataset that works only inside
a worker works; and no batch is refused for its size (one larger than the slots comes in
memory of its own). Each case runs the same objects through torch's DataLoader and
pinfeed's and compares what each ``next()`` gave, epoch by epoch, at 0 and 2 workers."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import pinfeed
from tests.conftest import Server
from tests.dataloader.test_parity import _clone as clone
from tests.helpers import assert_same

WORKERS = [0, 2]


class Logged(Dataset[Any]):
    """Appends each index it reads to ``log``, in the process that reads it."""

    def __init__(self, log: Path, n: int = 12) -> None:
        self.log, self.n = str(log), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor([i, i * i])


class RaisesAt(Dataset[Any]):
    """Raises ``ValueError`` for the indices in ``bad`` (all of them: every index)."""

    def __init__(self, bad: set[int] | None, n: int = 16) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.bad is None or i in self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return torch.tensor([i])


class IterRaises(IterableDataset[Any]):
    """Yields ``good`` samples, then raises ``KeyError``, as a broken shard does."""

    def __init__(self, good: int) -> None:
        self.good = good

    def __iter__(self) -> Any:
        for i in range(self.good):
            yield torch.tensor([i])
        raise KeyError("shard-3")


class OnlyInAWorker(Dataset[Any]):
    """Works only inside a DataLoader worker (it opens its source per worker)."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        assert info is not None, "read outside a worker"
        return torch.tensor([i, info.num_workers])


class OnlyInAWorkerStream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        info = get_worker_info()
        assert info is not None, "iterated outside a worker"
        for i in range(info.id, 30, info.num_workers):
            yield torch.tensor([i])


class Growing(Dataset[Any]):
    """Samples whose size grows with their index: a later batch outgrows the first's."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        return torch.arange(i * 997, dtype=torch.float64)


def outcomes(make: Callable[[], Any], epochs: int = 2) -> list[list[Any]]:
    """What each ``next()`` of each epoch gave: the batch, or the exception's type."""
    loader = make()
    out = []
    for _ in range(epochs):
        got: list[Any] = []
        it = iter(loader)
        for _ in range(1000):
            try:
                got.append(clone(next(it)))
            except StopIteration:
                break
            except Exception as exc:
                got.append(("raised", type(exc)))
        out.append(got)
    if isinstance(loader, pinfeed.DataLoader):
        loader.close()
    return out


def assert_same_outcomes(theirs: list[list[Any]], ours: list[list[Any]]) -> None:
    assert len(theirs) == len(ours)
    for a_epoch, b_epoch in zip(theirs, ours, strict=True):
        assert len(a_epoch) == len(b_epoch)
        for a, b in zip(a_epoch, b_epoch, strict=True):
            if isinstance(a, tuple) and a[:1] == ("raised",):
                # the user's own type (pinfeed's is also a SampleError carrying context)
                assert isinstance(b, tuple) and issubclass(b[1], a[1]), (a, b)
            else:
                assert_same(a, b)


def both(server: Server, **kwargs: Any) -> tuple[list[list[Any]], list[list[Any]]]:
    dataset = kwargs.pop("dataset")
    theirs = outcomes(lambda: TorchDataLoader(dataset, **kwargs))
    ours = outcomes(lambda: pinfeed.DataLoader(dataset, socket=server.socket, **kwargs))
    return theirs, ours


@pytest.mark.parametrize("workers", WORKERS)
def test_no_sample_is_read_before_the_loop_asks(
    server: Server, tmp_path: Path, workers: int
) -> None:
    log = tmp_path / "reads"
    log.touch()
    loader = pinfeed.DataLoader(
        Logged(log), batch_size=4, num_workers=workers, socket=server.socket
    )
    assert log.read_text() == "", "a sample was read when the loader was made"
    ours = [clone(b) for b in loader]
    assert log.read_text() != ""
    loader.close()
    assert_same([b for b in TorchDataLoader(Logged(log), batch_size=4)], ours)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("bad", [{5}, None], ids=["one-index", "every-index"])
def test_a_getitem_that_raises(server: Server, workers: int, bad: set[int] | None) -> None:
    theirs, ours = both(server, dataset=RaisesAt(bad), batch_size=4, num_workers=workers)
    assert any(isinstance(b, tuple) and b[:1] == ("raised",) for b in theirs[0])
    assert_same_outcomes(theirs, ours)


@pytest.mark.parametrize("workers", WORKERS)
def test_an_iter_that_raises(server: Server, workers: int) -> None:
    theirs, ours = both(server, dataset=IterRaises(6), batch_size=4, num_workers=workers)
    assert_same_outcomes(theirs, ours)


def test_a_collate_fn_that_raises_is_the_loops_error(server: Server) -> None:
    def broken(samples: list[Any]) -> Any:
        if len(samples) < 4:
            raise KeyError("short batch")
        return torch.stack(samples)

    for workers in WORKERS:
        theirs, ours = both(
            server, dataset=RaisesAt(set(), n=10), batch_size=4, collate_fn=broken,
            num_workers=workers,
        )  # fmt: skip
        assert theirs[0][-1] == ("raised", KeyError)
        assert_same_outcomes(theirs, ours)


def test_a_dataset_that_works_only_in_a_worker(server: Server) -> None:
    for dataset in (OnlyInAWorker(), OnlyInAWorkerStream()):
        theirs, ours = both(server, dataset=dataset, batch_size=4, num_workers=2)
        assert not any(isinstance(b, tuple) for b in theirs[0])
        assert_same_outcomes(theirs, ours)


@pytest.mark.parametrize("workers", WORKERS)
def test_no_batch_is_refused_for_its_size(server: Server, workers: int) -> None:
    """A batch_sampler of its own sizes, without a batch_size (a plain list of index
    lists), whose later batches outgrow the first: torch's batches, no max_batch_size."""
    batches = [[0], [1, 2], [39, 38, 37, 36, 35, 34, 33, 32], [3], list(range(10, 30))]
    theirs, ours = both(server, dataset=Growing(), batch_sampler=batches, num_workers=workers)
    assert_same_outcomes(theirs, ours)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_collate_fn_whose_batches_grow(server: Server, workers: int) -> None:
    def padded(samples: list[Any]) -> Any:
        n = max(len(s) for s in samples)
        return torch.stack([torch.nn.functional.pad(s, (0, n - len(s))) for s in samples])

    theirs, ours = both(
        server, dataset=Growing(), batch_size=5, collate_fn=padded, num_workers=workers
    )
    assert_same_outcomes(theirs, ours)


class Slow(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i >= 2:
            time.sleep(3)
        return torch.tensor([i])


@pytest.mark.slow
def test_a_timeout_is_dataloaders(server: Server) -> None:
    """DataLoader's ``timeout`` bounds the wait for a batch from its workers: its own
    RuntimeError, in its words, at the batch that comes too late."""
    for cls, extra in ((TorchDataLoader, {}), (pinfeed.DataLoader, {"socket": server.socket})):
        loader = cls(Slow(), batch_size=2, num_workers=1, timeout=1, **extra)
        it = iter(loader)
        assert next(it).tolist() == [[0], [1]]
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1 seconds"):
            next(it)
        del it
        if isinstance(loader, pinfeed.DataLoader):
            loader.close()


class Index(Dataset[Any]):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> Any:
        return i


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_of_more_indices_than_a_message_holds(server: Server, workers: int) -> None:
    kw: dict[str, Any] = {"batch_size": 40_960, "shuffle": True, "num_workers": workers}
    torch.manual_seed(1)
    theirs = next(iter(TorchDataLoader(Index(), **kw)))
    torch.manual_seed(1)
    loader = pinfeed.DataLoader(Index(), socket=server.socket, strict=True, **kw)
    assert torch.equal(next(iter(loader)), theirs)
    loader.close()


class Tagged(Dataset[Any]):
    """Its worker_init_fn is its own method: it sets up the copy its worker reads."""

    def __init__(self) -> None:
        self.worker = -1

    def init(self, worker_id: int) -> None:
        self.worker = worker_id

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, self.worker])


def test_a_worker_init_fn_that_is_the_datasets_own_method(server: Server) -> None:
    for persistent in (False, True):
        kw: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "persistent_workers": persistent}
        ds = Tagged()
        theirs = [
            b.clone() for _ in range(2) for b in TorchDataLoader(ds, worker_init_fn=ds.init, **kw)
        ]
        ds = Tagged()
        loader = pinfeed.DataLoader(ds, worker_init_fn=ds.init, socket=server.socket, **kw)
        ours = [b.clone() for _ in range(2) for b in loader]
        loader.close()
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]


class Crashes(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i == 5:
            ctypes.string_at(0)  # a segmentation fault in the process that reads it
        return torch.tensor([i])


@pytest.mark.slow
def test_a_sample_that_kills_its_worker(server: Server) -> None:
    """DataLoader raises a RuntimeError naming the worker (and the signal, where it saw
    one); so does pinfeed's (its pool tries the batch again twice, in new workers,
    first)."""
    for cls, extra in ((TorchDataLoader, {}), (pinfeed.DataLoader, {"socket": server.socket})):
        loader = cls(Crashes(), batch_size=2, num_workers=2, **extra)
        killed = r"DataLoader worker \(pid(\(s\))? \d+\) (is killed by signal|exited unexpectedly)"
        with pytest.raises(RuntimeError, match=killed):
            for _ in loader:
                pass
        if isinstance(loader, pinfeed.DataLoader):
            loader.close()
