"""The cache over HTTP: who may have one (422 naming what moved), what it reports
(``GET /v1/datasets/{name}``, ``/metrics``, ``pinfeed datasets ls``), its budget (507),
``DELETE /v1/datasets/{name}/cache`` (409 while read), and that a dataset's cache comes
back with it after a restart."""

from __future__ import annotations

from typing import Any

import pytest

from pinfeed import Client, Conflict, InsufficientMemory, InvalidRequest, Loader, NotFound
from tests.api.conftest import MakeServer
from tests.cli.test_cli import ok
from tests.conftest import Server
from tests.helpers import unique

PAIRS = {"factory": "tests.fixtures.datasets:Pairs", "kwargs": {"length": 30}}


def _python(factory: str, **kwargs: Any) -> dict[str, Any]:
    return {"factory": f"tests.fixtures.{factory}", "kwargs": kwargs}


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        ("datasets:Noisy", "moved torch's global RNG"),
        ("datasets:NumpyNoisy", "moved numpy's global RNG"),
        ("datasets:Drifting", "two reads of sample 0 differ"),
        ("iterables:Shards", "map-style"),
    ],
)
def test_a_dataset_that_is_not_deterministic_is_refused(
    admin: Client, factory: str, needle: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        admin.create_dataset(unique("c"), "python", _python(factory), cache={})
    assert needle in err.value.detail
    if "RNG" in needle or "differ" in needle:
        assert "transform" in err.value.detail  # what to do
    admin.create_dataset(unique("c"), "python", _python(factory))  # fine without a cache


def test_a_transform_that_writes_into_its_input_is_refused_over_a_cache(admin: Client) -> None:
    ds = unique("c")
    admin.create_dataset(ds, "python", PAIRS, cache={})
    with pytest.raises(InvalidRequest, match="writes into the sample"):
        admin.create_loader(
            unique("l"), dataset=ds, batch_size=4, transform="tests.fixtures.transforms:in_place"
        )
    with pytest.raises(InvalidRequest, match="map-style"):
        admin.create_dataset(unique("c"), "python", _python("iterables:Shards"), cache={})
    with pytest.raises(InvalidRequest, match=r"transform .* not allowed"):
        admin.create_loader(unique("l"), dataset=ds, batch_size=4, transform="os:getcwd")
    admin.delete_dataset(ds)


def test_what_a_cache_reports_and_drop(admin: Client, server: Server) -> None:
    ds, name = unique("c"), unique("l")
    created = admin.create_dataset(ds, "python", PAIRS, cache={"max_bytes": None})
    cache = created["cache"]
    assert cache["samples"] == 0 and cache["misses"] == 0 and cache["persisted"] is False
    assert cache["max_bytes"] > cache["bytes"] > 0
    admin.create_loader(name, dataset=ds, batch_size=5, shuffle=True, seed=1, num_workers=1)
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            assert len(list(loader)) == 6
    got = admin.dataset(ds)["cache"]
    assert (got["samples"], got["misses"]) == (30, 30)
    assert got["hits"] >= 30 and got["hit_ratio"] == got["hits"] / (got["hits"] + 30)
    metrics = admin.metrics()
    for series, value in (("samples", 30), ("misses_total", 30), ("persisted", 0)):
        assert f'pinfeed_dataset_cache_{series}{{dataset="{ds}"}} {value}\n' in metrics
    assert "pinfeed_cache_budget_bytes " in metrics
    assert "30/30 samples" in ok(server, "datasets", "ls")
    with pytest.raises(Conflict, match="read by loaders"):
        admin.drop_cache(ds)
    admin.delete_loader(name)
    dropped = admin.drop_cache(ds)["cache"]
    assert dropped["samples"] == 0 and dropped["bytes"] == created["cache"]["bytes"]
    with pytest.raises(NotFound, match="has no cache"):
        plain = unique("c")
        admin.create_dataset(plain, "python", PAIRS)
        admin.drop_cache(plain)
    admin.delete_dataset(ds)


@pytest.mark.slow
def test_caches_share_the_budget_and_come_back_after_a_restart(make_server: MakeServer) -> None:
    # Pairs(400, 1024): 400 records of ~4.2 KB, ~1.7 MB for the whole dataset
    big = {"factory": "tests.fixtures.datasets:Pairs", "kwargs": {"length": 400, "width": 1024}}
    server = make_server(PINFEED_CACHE_MAX_BYTES=str(2 << 20), PINFEED_MAX_SHM_BYTES=str(64 << 20))
    with server.client() as admin:
        admin.create_dataset("a", "python", big, cache={})
        with pytest.raises(InsufficientMemory, match="PINFEED_CACHE_MAX_BYTES") as err:
            admin.create_dataset("b", "python", big, cache={})
        assert err.value.need_bytes is not None and err.value.free_bytes is not None
        admin.create_dataset("b", "python", big, cache={"max_bytes": 150_000})
        assert admin.dataset("b")["cache"]["max_bytes"] == 150_000
        before = admin.dataset("a")["cache"]
    server.stop()
    server.start()
    with server.client() as admin:
        after = admin.dataset("a")["cache"]
        assert after["max_bytes"] == before["max_bytes"] and after["samples"] == 0
        assert admin.dataset("b")["cache"]["max_bytes"] == 150_000
