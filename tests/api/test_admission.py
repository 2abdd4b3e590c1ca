"""A loader whose ring would exceed PINFEED_MAX_SHM_BYTES is refused with 507; one whose
worker processes would take the server past PINFEED_MAX_WORKERS with 409 worker-limit.

Over HTTP: the status, the problem body's fields and the client's typed exceptions. The
rules themselves (what counts against whom, a live change admitted against the other
loaders, what a refusal leaves behind) are tested in-process in tests/test_service.py.
One server with both limits serves the module; each test deletes what it made, so the
next one finds the whole budget free.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pinfeed import Client, Conflict, InsufficientMemory, WorkerLimit
from tests.api.conftest import synthetic
from tests.api.test_datasets import _problem
from tests.conftest import Server

BUDGET = 8 << 20
MAX_WORKERS = 3
SAMPLE = 3 * 64 * 64 * 4 + 8  # float32 image + int64 label


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"PINFEED_MAX_SHM_BYTES": str(BUDGET), "PINFEED_MAX_WORKERS": str(MAX_WORKERS)}
    server = Server(tmp_path_factory.mktemp("limited"), env=env)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def c(limited: Server) -> Iterator[Client]:
    with limited.client() as client:
        yield client
        for lo in client.loaders():
            client.delete_loader(lo["name"])
        for ds in client.datasets():
            client.delete_dataset(ds["name"])


def test_rings_over_the_budget_get_507_with_free_and_needed_bytes(
    limited: Server, c: Client
) -> None:
    c.create_dataset("img", "synthetic", synthetic(64, (3, 64, 64)))
    # 4 slots of ~0.8 MB: one made ahead, three for the trainer (in use, two announced)
    small = c.create_loader("small", dataset="img", batch_size=16)
    used = small["ring_bytes"]
    assert used >= 4 * 16 * SAMPLE

    r = httpx.post(
        f"{limited.url}/v1/loaders", json={"name": "big", "dataset": "img", "batch_size": 32}
    )
    problem = _problem(r, 507, "insufficient-memory")
    assert problem["free_bytes"] == BUDGET - used
    need = int(str(problem["need_bytes"]))
    assert BUDGET > need >= 4 * 32 * SAMPLE > BUDGET - used
    assert "PINFEED_MAX_SHM_BYTES" in str(problem["detail"])

    with pytest.raises(InsufficientMemory) as info:  # 3 workers: 9 slots
        c.create_loader("wide", dataset="img", batch_size=16, num_workers=3)
    assert info.value.free_bytes == BUDGET - used
    assert info.value.need_bytes is not None and info.value.need_bytes > BUDGET - used

    c.delete_loader("small")  # its ring goes back to the budget
    assert c.create_loader("big", dataset="img", batch_size=32)["state"] in ("starting", "ready")


def test_worker_processes_past_the_server_bound_get_409_worker_limit(
    limited: Server, c: Client
) -> None:
    c.create_dataset("d", "synthetic", synthetic(16))
    c.create_loader("two", dataset="d", batch_size=4, num_workers=2)
    r = httpx.post(
        f"{limited.url}/v1/loaders",
        json={"name": "more", "dataset": "d", "batch_size": 4, "num_workers": 2},
    )
    problem = _problem(r, 409, "worker-limit")
    assert (problem["max_workers"], problem["free_workers"]) == (MAX_WORKERS, 1)
    assert f"PINFEED_MAX_WORKERS={MAX_WORKERS}" in str(problem["detail"])
    with pytest.raises(WorkerLimit) as info:  # also a Conflict, for old callers
        c.create_loader("alone", dataset="d", batch_size=4, num_workers=4)
    assert isinstance(info.value, Conflict) and info.value.status == 409
    c.create_loader("one", dataset="d", batch_size=4, num_workers=1)  # exactly the bound
    r = httpx.patch(f"{limited.url}/v1/loaders/two", json={"num_workers": 3})
    assert _problem(r, 409, "worker-limit")["free_workers"] == 2
    with pytest.raises(WorkerLimit):
        c.patch_loader("two", num_workers=3)
    assert c.patch_loader("two", num_workers=1)["num_workers"] == 1  # fewer: always


def test_a_patch_whose_ring_outgrows_the_budget_gets_507(limited: Server, c: Client) -> None:
    c.create_dataset("img", "synthetic", synthetic(64, (3, 64, 64)))
    # 5 slots of ~1.3 MB (1 x 2 ahead, 3 the trainer's); 7 with 2 workers do not fit
    lo = c.create_loader("lo", dataset="img", batch_size=26, num_workers=1)
    slot = lo["slot_bytes"]
    r = httpx.patch(f"{limited.url}/v1/loaders/lo", json={"num_workers": 2})
    problem = _problem(r, 507, "insufficient-memory")
    assert problem["need_bytes"] == (2 * 2 + 3) * slot
    assert problem["free_bytes"] == BUDGET  # this loader's own ring is in the free
    with pytest.raises(InsufficientMemory):
        c.patch_loader("lo", prefetch_factor=64)
    assert c.loader("lo")["num_workers"] == 1
    assert c.patch_loader("lo", prefetch_factor=3)["slots"]["total"] == 1 * 3 + 3  # it grew
