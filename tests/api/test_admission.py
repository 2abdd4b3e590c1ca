"""A loader whose ring would exceed PINFEED_MAX_SHM_BYTES is refused with 507; one whose
worker processes would take the server past PINFEED_MAX_WORKERS with 409 worker-limit."""

from __future__ import annotations

import httpx
import pytest

from pinfeed import Conflict, InsufficientMemory, WorkerLimit
from tests.api.conftest import MakeServer, synthetic
from tests.api.test_datasets import _problem

BUDGET = 6 << 20
SAMPLE = 3 * 64 * 64 * 4 + 8  # float32 image + int64 label


def test_rings_over_the_budget_get_507_with_free_and_needed_bytes(
    make_server: MakeServer,
) -> None:
    server = make_server(PINFEED_MAX_SHM_BYTES=str(BUDGET))
    with server.client() as c:
        c.create_dataset("img", "synthetic", synthetic(64, (3, 64, 64)))
        # 3 slots of ~0.8 MB: one made ahead, two for the trainer (in use, announced ahead)
        small = c.create_loader("small", dataset="img", batch_size=16)
        used = small["ring_bytes"]
        assert used >= 3 * 16 * SAMPLE

        r = httpx.post(
            f"{server.url}/v1/loaders", json={"name": "big", "dataset": "img", "batch_size": 32}
        )
        problem = _problem(r, 507, "insufficient-memory")
        assert problem["free_bytes"] == BUDGET - used
        need = int(str(problem["need_bytes"]))
        assert BUDGET > need >= 3 * 32 * SAMPLE > BUDGET - used
        assert "PINFEED_MAX_SHM_BYTES" in str(problem["detail"])

        with pytest.raises(InsufficientMemory) as info:
            c.create_loader("wide", dataset="img", batch_size=16, num_workers=4)
        assert info.value.free_bytes == BUDGET - used
        assert info.value.need_bytes is not None and info.value.need_bytes > BUDGET - used
        assert "wide" not in [lo["name"] for lo in c.loaders()]

        c.delete_loader("small")  # its ring goes back to the budget
        assert c.create_loader("big", dataset="img", batch_size=32)["state"] in (
            "starting",
            "ready",
        )


def test_worker_processes_past_the_server_bound_get_409_worker_limit(
    make_server: MakeServer,
) -> None:
    server = make_server(PINFEED_MAX_WORKERS="3")
    with server.client() as c:
        c.create_dataset("d", "synthetic", synthetic(16))
        c.create_loader("two", dataset="d", batch_size=4, num_workers=2)
        r = httpx.post(
            f"{server.url}/v1/loaders",
            json={"name": "more", "dataset": "d", "batch_size": 4, "num_workers": 2},
        )
        problem = _problem(r, 409, "worker-limit")
        assert (problem["max_workers"], problem["free_workers"]) == (3, 1)
        assert "PINFEED_MAX_WORKERS=3" in str(problem["detail"])
        with pytest.raises(WorkerLimit) as info:  # also a Conflict, for old callers
            c.create_loader("alone", dataset="d", batch_size=4, num_workers=4)
        assert isinstance(info.value, Conflict) and info.value.status == 409
        c.create_loader("one", dataset="d", batch_size=4, num_workers=1)  # exactly the bound
        with pytest.raises(WorkerLimit):
            c.patch_loader("two", num_workers=3)
        c.patch_loader("two", num_workers=1)  # fewer is always allowed
        assert {lo["name"] for lo in c.loaders()} == {"two", "one"}
        c.delete_loader("one")
        assert c.create_loader("more", dataset="d", batch_size=4, num_workers=2)["num_workers"] == 2


def test_a_patch_whose_ring_outgrows_the_budget_gets_507(make_server: MakeServer) -> None:
    server = make_server(PINFEED_MAX_SHM_BYTES=str(8 << 20))
    with server.client() as c:
        c.create_dataset("img", "synthetic", synthetic(64, (3, 64, 64)))
        lo = c.create_loader("lo", dataset="img", batch_size=16, num_workers=1)
        slot = lo["slot_bytes"]
        r = httpx.patch(f"{server.url}/v1/loaders/lo", json={"num_workers": 8})
        problem = _problem(r, 507, "insufficient-memory")
        assert problem["need_bytes"] == (8 * 2 + 2) * slot
        assert problem["free_bytes"] == 8 << 20  # this loader's own ring is in the free
        with pytest.raises(InsufficientMemory):
            c.patch_loader("lo", prefetch_factor=64)
        assert c.loader("lo")["num_workers"] == 1
        assert c.patch_loader("lo", num_workers=2)["slots"]["total"] == 6
