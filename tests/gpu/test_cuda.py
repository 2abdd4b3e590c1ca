"""CUDA paths: pinned ring views, device copies, and slot reuse only after the copy.

Skipped without CUDA (see tests/conftest.py); run on a GPU machine with
``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.helpers import assert_same, unique

pytestmark = pytest.mark.gpu

PARAMS: dict[str, Any] = {
    "length": 200,
    "seed": 1,
    "fields": [
        {"shape": [3, 32, 32], "dtype": "float32"},
        {"shape": [], "dtype": "int64", "low": 0, "high": 10},
    ],
}


@pytest.fixture()
def dataset(admin: Client, server: Server) -> tuple[str, Any]:
    name = unique("gpu")
    admin.create_dataset(name, "synthetic", PARAMS)
    return name, build_dataset("synthetic", PARAMS, DatasetContext(server.data_root))


def test_pin_memory_views_are_pinned(
    admin: Client, server: Server, dataset: tuple[str, Any]
) -> None:
    name = unique("pinned")
    admin.create_loader(name, dataset=dataset[0], batch_size=16, pin_memory=True, num_workers=2)
    with Loader(name, socket=server.socket) as loader:
        assert loader.cuda_registered
        for x, y in loader:
            assert x.is_pinned() and y.is_pinned()
            assert loader.ring_contains(x)
    name2 = unique("unpinned")
    admin.create_loader(name2, dataset=dataset[0], batch_size=16, pin_memory=False)
    with Loader(name2, socket=server.socket) as loader:
        x, _ = next(iter(loader))
        assert not x.is_pinned()


def test_device_copy_equals_dataloader(
    admin: Client, server: Server, dataset: tuple[str, Any]
) -> None:
    name = unique("dev")
    admin.create_loader(
        name,
        dataset=dataset[0],
        batch_size=16,
        shuffle=True,
        seed=9,
        pin_memory=True,
        num_workers=2,
    )
    ref = DataLoader(
        dataset[1],
        batch_size=16,
        shuffle=True,
        pin_memory=True,
        generator=torch.Generator().manual_seed(9),
    )
    with Loader(name, socket=server.socket, device="cuda") as loader:
        for _ in range(2):
            for got, want in zip(loader, ref, strict=True):
                assert got[0].device.type == "cuda"
                assert_same([t.cpu() for t in got], want)


def test_slot_not_rewritten_before_its_copy_completed(
    admin: Client, server: Server, dataset: tuple[str, Any]
) -> None:
    """Stall the copy stream with a long kernel before each copy: if a slot were
    released before its copy ran, the producer would overwrite it and the copied
    data would belong to a later batch."""
    name = unique("slow")
    # Two slots only: any early release would be reused at once.
    admin.create_loader(name, dataset=dataset[0], batch_size=8, pin_memory=True, num_workers=0)
    ref = DataLoader(dataset[1], batch_size=8)
    kept = []
    with Loader(name, socket=server.socket, device="cuda") as loader:
        stream = loader._conn.delivery.stream
        assert stream is not None
        for got, want in zip(loader, ref, strict=True):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time queued before the next copy
            kept.append((got, want))
        torch.cuda.synchronize()
    for got, want in kept:
        assert_same([t.cpu() for t in got], want)


def test_pinfeed_dataloader_pins_and_copies_as_dataloader(
    server: Server, dataset: tuple[str, Any]
) -> None:
    """The one-line switch on a GPU node: ``pin_memory=True`` gives pinned batches (the
    ring registered with CUDA once), ``device="cuda"`` the non_blocking copy; both equal
    torch's pinned DataLoader batch for batch."""
    import pinfeed

    ds = dataset[1]
    want = list(DataLoader(ds, batch_size=16, pin_memory=True))
    pinned = pinfeed.DataLoader(
        ds, batch_size=16, pin_memory=True, num_workers=2, socket=server.socket
    )
    for (x, y), (wx, wy) in zip(pinned, want, strict=True):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, wx) and torch.equal(y, wy)
    pinned.close()
    on_gpu = pinfeed.DataLoader(
        ds, batch_size=16, num_workers=2, device="cuda", socket=server.socket
    )
    for (x, y), (wx, wy) in zip(on_gpu, want, strict=True):
        assert x.is_cuda and torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)
    on_gpu.close()
