"""The trainer's view: errors, one consumer per loader, pin warnings, lifecycle."""

from __future__ import annotations

import warnings
from pathlib import Path

import httpx
import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import (
    BatchTooLarge,
    Client,
    Loader,
    LoaderBusy,
    NotFound,
    SampleError,
    ServerUnavailable,
)
from pinfeed._connection import PIN_WARNING
from pinfeed.protocol import NEXTS_IN_FLIGHT
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.helpers import unique
from tests.reliability.procs import wait_for

FLAKY = {"factory": "tests.fixtures.datasets:Flaky", "kwargs": {"length": 40, "fail_at": 13}}


@pytest.fixture(scope="module")
def flaky(server: Server) -> str:
    name = unique("flaky")
    with server.client() as c:
        c.create_dataset(name, "python", FLAKY)
    return name


def _synthetic(admin: Client, length: int = 32) -> str:
    name = unique("syn")
    admin.create_dataset(
        name,
        "synthetic",
        {
            "length": length,
            "fields": [
                {"shape": [4], "dtype": "float32"},
                {"shape": [], "dtype": "int64", "high": 5},
            ],
        },
    )
    return name


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sample_error_names_the_index_and_the_loader_recovers(
    admin: Client, server: Server, flaky: str, num_workers: int
) -> None:
    name = unique("err")
    admin.create_loader(name, dataset=flaky, batch_size=4, num_workers=num_workers)
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        for b in range(3):  # batches 0-2: indices 0..11
            _, y = next(it)
            assert y.tolist() == list(range(4 * b, 4 * b + 4))
        with pytest.raises(SampleError) as info:
            next(it)  # batch 3 holds index 13
        assert info.value.index == 13
        assert info.value.error_type == "ValueError"
        assert "corrupt record 13" in str(info.value)
        _x, y = next(it)  # the iterator goes on with the next batch, as DataLoader's does
        assert y.tolist() == [16, 17, 18, 19]
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert admin.loader(name)["state"] == "ready"
    assert admin.loader_stats(name)["errors"] >= 1
    admin.delete_loader(name)
    admin.create_loader(name, dataset=flaky, batch_size=4, num_workers=num_workers)
    with Loader(name, socket=server.socket) as loader:
        assert next(iter(loader))[1].tolist() == [0, 1, 2, 3]
    admin.delete_loader(name)


def test_one_consumer_per_loader(admin: Client, server: Server) -> None:
    name = unique("busy")
    admin.create_loader(name, dataset=_synthetic(admin), batch_size=4)
    with Loader(name, socket=server.socket) as first:
        next(iter(first))
        with pytest.raises(LoaderBusy, match="already has a consumer"):
            Loader(name, socket=server.socket)
        assert admin.loader(name)["consumer_attached"] is True
        # The batch in use, and the next two announced ahead (NEXTS_IN_FLIGHT).
        wait_for(lambda: admin.loader(name)["slots"]["leased"] == 1 + NEXTS_IN_FLIGHT, "leases")
    # The first consumer's slots came back; a new consumer can attach.
    with Loader(name, socket=server.socket) as second:
        next(iter(second))
    admin.delete_loader(name)


def test_unknown_loader_and_missing_server(server: Server, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no loader named"):
        Loader("nope", socket=server.socket)
    with pytest.raises(ServerUnavailable, match="pinfeed serve"):
        Loader("demo", socket=tmp_path / "absent.sock")


def test_pin_memory_without_cuda_warns_like_dataloader(admin: Client, server: Server) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinned views are tested in tests/gpu")
    name = unique("pin")
    admin.create_loader(name, dataset=_synthetic(admin), batch_size=4, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        loader = Loader(name, socket=server.socket)
    with loader:
        x, _ = next(iter(loader))
        assert not x.is_pinned()
        assert not loader.cuda_registered
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.utils.data.DataLoader([0], pin_memory=True).__iter__()
    assert str(seen[0].message) == PIN_WARNING
    admin.delete_loader(name)


def test_cuda_device_without_cuda_is_a_clear_error(server: Server) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Loader("demo", socket=server.socket, device="cuda")


def test_batch_larger_than_its_slot_is_an_error(admin: Client, server: Server) -> None:
    ds = unique("grow")
    admin.create_dataset(ds, "python", {"factory": "tests.fixtures.datasets:Growing"})
    name = unique("grow")
    admin.create_loader(name, dataset=ds, batch_size=2, num_workers=1)
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        with pytest.raises(SampleError, match="stack expects each tensor to be equal size"):
            next(it)  # batch 0 is ragged: DataLoader's error (tests/features/test_collate.py)
        with pytest.raises(BatchTooLarge, match="max_batch_bytes"):
            next(it)  # batch 1 is larger than the slots sized from sample 0
    admin.delete_loader(name)


def test_deleting_a_loader_under_a_trainer(admin: Client, server: Server) -> None:
    name = unique("del")
    admin.create_loader(name, dataset=_synthetic(admin, 400), batch_size=1)
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        next(it)
        admin.delete_loader(name)
        with pytest.raises(ServerUnavailable):
            for _ in range(400):
                next(it)


def test_len_is_batches_per_epoch(admin: Client, server: Server) -> None:
    name = unique("len")
    admin.create_loader(name, dataset=_synthetic(admin, 30), batch_size=7, drop_last=True)
    with Loader(name, socket=server.socket) as loader:
        assert len(loader) == 4
        assert sum(1 for _ in loader) == 4
        assert sum(1 for _ in loader) == 4
    admin.delete_loader(name)


def test_consumer_wait_is_measured_by_the_trainer(admin: Client, server: Server) -> None:
    """A slow dataset makes the trainer wait: the stats say it is input-bound."""
    ds = unique("slow")
    admin.create_dataset(
        ds, "python", {"factory": "tests.fixtures.datasets:Slow", "kwargs": {"seconds": 0.02}}
    )
    name = unique("slow")
    admin.create_loader(name, dataset=ds, batch_size=2, num_workers=0)
    with Loader(name, socket=server.socket) as loader:
        for _ in loader:
            pass
    stats = admin.loader_stats(name)
    assert stats["consumer_wait_p50_s"] is not None and stats["consumer_wait_p50_s"] > 0.02
    assert stats["consumer_wait_share"] > 0.5
    admin.delete_loader(name)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_error_skip_drops_the_failing_batch_and_counts_it(
    admin: Client, server: Server, flaky: str, num_workers: int
) -> None:
    """on_error="skip": the batch holding the bad sample (index 13, batch 3) is left out,
    logged and counted; every other batch comes in order."""
    name = unique("skip")
    admin.create_loader(name, dataset=flaky, batch_size=4, num_workers=num_workers, on_error="skip")
    with Loader(name, socket=server.socket) as loader:
        labels = [y.tolist() for _, y in loader]
    want = [list(range(4 * b, 4 * b + 4)) for b in range(10) if b != 3]
    assert labels == want
    stats = admin.loader_stats(name)
    # Prefetch runs on into epoch 1 and may meet sample 13 again before we look.
    assert stats["errors"] >= 1 and stats["skipped"] == stats["errors"]
    admin.delete_loader(name)


def test_yielded_tensors_are_new_objects_each_batch(admin: Client, server: Server) -> None:
    """Views of a slot are cached, but every batch gets its own tensor objects: a trainer
    that reshapes a batch in place does not change the next batch from that slot."""
    params = {
        "length": 30,  # 7 full batches of 4 and one of 2
        "fields": [
            {"shape": [4], "dtype": "float32"},
            {"shape": [], "dtype": "int64", "high": 5},
        ],
    }
    ds = unique("fresh")
    admin.create_dataset(ds, "synthetic", params)
    name = unique("fresh")
    admin.create_loader(name, dataset=ds, batch_size=4)
    local = build_dataset("synthetic", params, DatasetContext(server.data_root))
    want = [b for _ in range(2) for b in DataLoader(local, batch_size=4)]
    got = 0
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            for x, y in loader:
                assert torch.equal(x, want[got][0]) and torch.equal(y, want[got][1])
                x.unsqueeze_(0)  # the trainer's own reshaping stays with its tensors
                y.resize_(0)
                got += 1
    assert got == len(want) == 16
    admin.delete_loader(name)
