"""``IterableDataset``: DataLoader's semantics, checked against a real DataLoader.

Every worker iterates its own copy, splits the shards with ``get_worker_info()``,
batches come from the workers round-robin and a worker that runs out drops out,
``drop_last`` applies per worker, each epoch is a new iterator; randomness inside
``__iter__`` and in every sample is DataLoader's (same generator seed). At
``num_workers=0`` pinfeed is DataLoader's one non-persistent worker (the loader's own
RNGs), which is what the reference uses there."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, InvalidRequest, Loader, SampleError
from tests.conftest import Server
from tests.fixtures.iterables import SIZES, Raising, Shards, Stateful, Unsized
from tests.helpers import (
    across_restart,
    assert_epochs_same,
    epochs_with,
    sigkill_worker,
    unique,
)

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
    ds = _dataset(admin, "Unsized")
    described = admin.dataset(ds)
    assert described["length"] is None and len(described["sample"]) == 4
    sized = _loader(admin, 2)
    assert admin.loader(sized)["batches_per_epoch"] == len(_reference_loader(Shards()))
    unsized = _loader(admin, 2, dataset=ds)
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


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (3, False), (2, True)]
)
def test_resume_mid_epoch_fast_forwards(
    admin: Client, server: Server, num_workers: int, persistent: bool
) -> None:
    """A checkpoint after 9 batches (past a worker's drop-out at 2 workers), 2 batches
    consumed after it, then a new Loader resumes: the server seeks back and each
    stream fast-forwards (Shards has no state_dict)."""
    want = _reference(2, num_workers, persistent_workers=persistent)
    name = _loader(admin, num_workers, persistent_workers=persistent)
    _check(_resumed(server, name, 8, 2), want)
    admin.delete_loader(name)


def _resumed(server: Server, name: str, before: int, after: int) -> list[list[Any]]:
    """Two epochs: ``before`` batches, a checkpoint, ``after`` batches more (lost), then
    a new Loader from the checkpoint (the server seeks back) for the rest."""
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        got = [_copy(next(it)) for _ in range(before)]
        state = loader.state_dict()
        for _ in range(after):
            next(it)
    with Loader(name, socket=server.socket) as loader:
        loader.load_state_dict(state)
        return [got + _epoch(loader), _epoch(loader)]


def test_resume_uses_the_datasets_state_dict(admin: Client, server: Server) -> None:
    """StatefulDataLoader's convention: a dataset with ``state_dict/load_state_dict``
    is put back from its own state (kept by the worker after each batch), not
    re-iterated from the start; the batches are DataLoader's uninterrupted ones."""
    want = _reference(2, 2, Stateful())
    name = _loader(admin, 2, dataset=_dataset(admin, "Stateful"))
    got, rest = _resumed(server, name, 5, 3)
    loads = [int(b[2].max()) for b in got]
    assert loads[:5] == [0] * 5 and max(loads[5:]) > 0  # the resumed streams were loaded
    assert all(int(b[2].max()) == 0 for b in rest)  # a new epoch: fresh copies
    _check([[b[:2] for b in got], [b[:2] for b in rest]], [[b[:2] for b in e] for e in want])
    admin.delete_loader(name)


@pytest.mark.parametrize("persistent", [False, True])
def test_sigkilled_worker_is_replaced_by_fast_forward(
    admin: Client, server: Server, persistent: bool
) -> None:
    """A worker SIGKILLed mid-epoch: its replacement fast-forwards the worker's
    streams to where they were, and the sequence is still DataLoader's."""
    want = _reference(2, 3, persistent_workers=persistent)
    name = _loader(admin, 3, persistent_workers=persistent)
    kill = {(0, 3): lambda: sigkill_worker(admin, server, name, 3, 1)}
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, 2, _copy, kill)
    _check(got, want)
    admin.delete_loader(name)


def test_patch_num_workers_keeps_the_streams(admin: Client, server: Server) -> None:
    """The streams stay DataLoader's 3 workers: after a PATCH to fewer or more
    processes, a moved stream is fast-forwarded in its new process."""
    want = _reference(2, 3)
    name = _loader(admin, 3)
    changes = {
        (0, 2): {"num_workers": 1},
        (0, 5): {"num_workers": 2},
        (1, 1): {"num_workers": 4, "prefetch_factor": 1},
    }
    at = {place: functools.partial(admin.patch_loader, name, **c) for place, c in changes.items()}
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, 2, _copy, at)
    _check(got, want)
    admin.delete_loader(name)


@pytest.mark.parametrize("mode", ["broadcast", "split"])
def test_groups(admin: Client, server: Server, mode: str) -> None:
    want = _reference(2, 2)
    name = _loader(admin, 2, group_size=2, group_mode=mode)
    got: list[list[list[Any]]] = [[], []]
    with (
        Loader(name, socket=server.socket, member=0) as a,
        Loader(name, socket=server.socket, member=1) as b,
    ):
        for _ in range(2):
            for member, epoch in enumerate(_lockstep(a, b)):
                got[member].append(epoch)
    if mode == "broadcast":
        _check(got[0], want)
        _check(got[1], want)
    else:  # the k-th batch of an epoch to member k % 2, gaps in the turns or not
        _check(got[0], [e[0::2] for e in want])
        _check(got[1], [e[1::2] for e in want])
    admin.delete_loader(name)


def _lockstep(*loaders: Any) -> list[list[Any]]:
    """One epoch of each loader, taking a batch from each in turn (a group's members
    run side by side)."""
    its = [iter(loader) for loader in loaders]
    out: list[list[Any]] = [[] for _ in loaders]
    live = set(range(len(its)))
    while live:
        for m in sorted(live):
            try:
                out[m].append(_copy(next(its[m])))
            except StopIteration:
                live.discard(m)
    return out


def test_ranks_shard_through_rank_and_world_size(admin: Client, server: Server) -> None:
    """Two loaders, rank 0 and 1 of world_size 2, on one dataset: each reads its shards
    (RANK/WORLD_SIZE, then get_worker_info()), as a DataLoader in a trainer where
    torchrun set them; together they read every sample once."""
    ds = _dataset(admin)
    names = [_loader(admin, 2, dataset=ds, rank=r, world_size=2) for r in range(2)]
    seen: list[list[int]] = []
    for rank, name in enumerate(names):
        with _env(RANK=str(rank), WORLD_SIZE="2"):
            want = _reference(1, 2)
        with Loader(name, socket=server.socket) as loader:
            got = [_epoch(loader)]
        _check(got, want)
        seen.append([int(x) for b in got[0] for x in b[0][:, 0] * 100 + b[0][:, 1]])
        admin.delete_loader(name)
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) + len(seen[1]) == sum(SIZES)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _reference_with_errors(num_workers: int) -> list[list[Any]]:
    """DataLoader's two epochs, going on after a batch raised (None: its iterator
    stays usable)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        dl = DataLoader(
            Raising(),
            batch_size=BATCH,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(SEED),
        )
        epochs: list[list[Any]] = []
        for _ in range(2):
            it = iter(dl)
            epochs.append([])
            while True:
                try:
                    epochs[-1].append(next(it))
                except ValueError:
                    epochs[-1].append(None)
                except StopIteration:
                    break
        return epochs


@pytest.mark.parametrize("num_workers", [2, 3])
def test_a_raising_iterator_fails_its_batch(
    admin: Client, server: Server, num_workers: int
) -> None:
    want = _reference_with_errors(num_workers)
    assert None in want[0]
    name = _loader(admin, num_workers, dataset=_dataset(admin, "Raising"))
    with Loader(name, socket=server.socket) as loader:
        for epoch in want:  # each a new iterator, the raising one fresh again
            got = _with_errors(loader)
            assert [b is None for b in got] == [b is None for b in epoch]
            _check([[b for b in got if b is not None]], [[b for b in epoch if b is not None]])
    admin.delete_loader(name)


def _with_errors(loader: Loader) -> list[Any]:
    """An epoch of ``loader``, None for each batch that raised (the loop goes on)."""
    it = iter(loader)
    got: list[Any] = []
    while True:
        try:
            got.append(_copy(next(it)))
        except SampleError as exc:
            assert "corrupt record" in str(exc)
            got.append(None)
        except StopIteration:
            return got


@pytest.mark.slow
def test_resume_across_server_restart(restartable: Server) -> None:
    """The loader comes back from the registry; its streams fast-forward to the
    checkpoint (the server's kept states died with it)."""
    want = _reference(2, 2, Stateful(), persistent_workers=True)
    got, rest = across_restart(
        restartable,
        lambda admin: _loader(
            admin, 2, dataset=_dataset(admin, "Stateful"), persistent_workers=True
        ),
        _copy,
    )
    assert all(int(b[2].max()) == 0 for b in got + rest)  # fast-forwarded, never loaded
    _check([[b[:2] for b in got], [b[:2] for b in rest]], [[b[:2] for b in e] for e in want])
