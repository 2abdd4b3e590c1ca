"""``/v1/loaders`` against a real server: config, live status, stats, refusals."""

from __future__ import annotations

import httpx
import pytest
import torch

from pinfeed import Client, Conflict, InvalidRequest, Loader, NotFound
from pinfeed.protocol import NEXTS_IN_FLIGHT
from tests.api.conftest import synthetic
from tests.api.test_datasets import _problem
from tests.conftest import Server
from tests.helpers import unique
from tests.reliability.procs import wait_for

DATALOADER_DEFAULTS = {
    "batch_size": 1,
    "shuffle": False,
    "drop_last": False,
    "num_workers": 0,
    "pin_memory": False,
    "prefetch_factor": 2,
}


@pytest.fixture(scope="module")
def dataset(server: Server) -> str:
    name = unique("lds")
    with server.client() as c:
        c.create_dataset(name, "synthetic", synthetic(20))
    return name


def test_defaults_are_dataloaders(server: Server, dataset: str) -> None:
    name = unique("defaults")
    r = httpx.post(f"{server.url}/v1/loaders", json={"name": name, "dataset": dataset})
    assert r.status_code == 201, r.text
    assert r.headers["location"] == f"/v1/loaders/{name}"
    body = r.json()
    assert {k: body[k] for k in DATALOADER_DEFAULTS} == DATALOADER_DEFAULTS
    assert isinstance(body["seed"], int)  # the server picked one and persisted it
    assert httpx.get(f"{server.url}/v1/loaders/{name}").json()["seed"] == body["seed"]


def test_prefetch_factor_null_is_dataloaders_default(server: Server, dataset: str) -> None:
    """``DataLoader(prefetch_factor=None)`` is its default, 2 (with workers); JSON null
    over HTTP is the same, not a 422."""
    name = unique("pf-null")
    body = {"name": name, "dataset": dataset, "num_workers": 1, "prefetch_factor": None}
    r = httpx.post(f"{server.url}/v1/loaders", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["prefetch_factor"] == 2
    assert r.json()["slots"]["total"] == 1 * 2 + 3  # the workers' ahead, the trainer's three
    r = httpx.post(
        f"{server.url}/v1/loaders", json=body | {"name": unique("pf"), "prefetch_factor": 0}
    )
    assert r.status_code == 422, r.text


def test_the_prefetch_depth_is_made_ahead_beside_a_trainers_nexts_in_flight(
    admin: Client, server: Server, dataset: str
) -> None:
    """A trainer holds its batch and one slot for each NEXT it keeps in flight (the
    batches sent, in its socket); the prefetch depth is made ahead beside them. With a
    slot less, the trainer's NEXTs took the depth's slot, and a loader without workers
    began each batch only once the one before was taken."""
    name = unique("depth")
    created = admin.create_loader(name, dataset=dataset, batch_size=2, num_workers=0)
    held = 1 + NEXTS_IN_FLIGHT
    assert created["slots"]["total"] == 1 + held  # the depth without workers, the trainer's
    with Loader(name, socket=server.socket, timeout=60) as loader:
        it = iter(loader)
        next(it)  # held: the trainer has its batch, and NEXTs in flight for two more

        def slots() -> tuple[int, int]:
            s = admin.loader(name)["slots"]
            return int(s["leased"]), int(s["filling"] + s["ready"])

        wait_for(lambda: slots() == (held, 1), f"{held} batches leased, 1 made ahead")
    admin.delete_loader(name)


def test_live_status_follows_the_consumer(admin: Client, server: Server, dataset: str) -> None:
    name = unique("live")
    admin.create_loader(
        name, dataset=dataset, batch_size=4, shuffle=True, seed=7, num_workers=1, prefetch_factor=3
    )
    with Loader(name, socket=server.socket, timeout=60) as loader:
        it = iter(loader)
        x, _ = next(it)
        assert x.shape == (4, 3, 8, 8) and x.dtype == torch.float32
        status = admin.loader(name)
        assert status["state"] == "ready"
        assert status["consumer_attached"] is True
        assert status["consumer_cuda_registered"] is False
        # The client keeps NEXTS_IN_FLIGHT NEXTs in flight: the server may have handed
        # out batches 1 and 2 too.
        assert status["epoch"] == 0 and 1 <= status["position"] <= 1 + NEXTS_IN_FLIGHT
        # 1 worker x prefetch_factor 3 made ahead, plus the trainer's three.
        assert (
            status["slots"]["total"]
            == 6
            == sum(status["slots"][s] for s in ("free", "filling", "ready", "leased"))
        )
        assert status["ring_bytes"] == 6 * status["slot_bytes"] >= 4 * (3 * 8 * 8 * 4 + 8)
        assert isinstance(status["page_locked"], bool)
        assert status["batches_per_epoch"] == 5
        assert status["batch"] == [
            {"dtype": "float32", "shape": [3, 8, 8]},
            {"dtype": "int64", "shape": []},
        ]
        assert status["worker_restarts"] == 0 and status["failure"] is None
        next(it)
        stats = admin.loader_stats(name)
    assert stats["name"] == name
    assert 2 <= stats["batches_consumed"] <= 2 + NEXTS_IN_FLIGHT
    assert stats["samples_consumed"] == 4 * stats["batches_consumed"]
    assert stats["batches_produced"] >= 2 and stats["errors"] == 0
    assert stats["consumer_wait_p50_s"] is not None
    assert 0 <= stats["consumer_wait_share"] <= 1 and stats["worker_busy_share"] >= 0
    assert stats["samples_per_s"] > 0 and stats["bytes_per_s"] > 0
    # The server sees the socket close on its own thread, a moment after close().
    wait_for(lambda: admin.loader(name)["consumer_attached"] is False, "the detach")
    assert name in [lo["name"] for lo in admin.loaders()]
    admin.delete_loader(name)
    with pytest.raises(NotFound):
        admin.loader(name)
    with pytest.raises(NotFound):
        admin.loader_stats(name)


def test_unknown_dataset_is_404(admin: Client) -> None:
    with pytest.raises(NotFound, match="no dataset"):
        admin.create_loader(unique("orphan"), dataset=unique("nope"))


def test_duplicate_name_is_409(admin: Client, dataset: str) -> None:
    name = unique("dupl")
    admin.create_loader(name, dataset=dataset)
    with pytest.raises(Conflict, match="exists"):
        admin.create_loader(name, dataset=dataset)
    admin.delete_loader(name)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"prefetch_factor": 0}, "prefetch_factor"),
        ({"seed": -1}, "seed"),
        ({"shuffle": "sometimes"}, "shuffle"),
        ({"sampler": "mine"}, "sampler"),
        ({"batch_size": 64, "drop_last": True}, "no batch"),
    ],
)
def test_invalid_config_is_422(
    admin: Client, dataset: str, config: dict[str, object], needle: str
) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        admin.create_loader(unique("bad"), dataset=dataset, **config)


@pytest.mark.parametrize("path", ["/v1/loaders/{}", "/v1/loaders/{}/stats"])
def test_unknown_loader_is_404(server: Server, path: str) -> None:
    _problem(httpx.get(server.url + path.format(unique("ghost"))), 404, "not-found")
    _problem(httpx.delete(f"{server.url}/v1/loaders/{unique('ghost')}"), 404, "not-found")
