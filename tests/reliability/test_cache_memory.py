"""A cache is mapped, not copied: a worker more over a filled cache costs the node the
PSS a worker more costs without one (its private memory), and the cache's pages are
counted once however many processes read them."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import pytest

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.helpers import unique
from tests.reliability.procs import cache_holders, descendants, wait_for

MiB = 1 << 20
LENGTH, WIDTH = 400, 65536  # 400 samples of 256 KiB: a 100 MiB cache
PARAMS = {"factory": "tests.fixtures.datasets:Pairs", "kwargs": {"length": LENGTH, "width": WIDTH}}


def _tree_pss(pid: int) -> int:
    procs = [psutil.Process(pid), *descendants(pid)]
    return sum(p.memory_full_info().pss for p in procs)


def _epoch(server: Server, name: str) -> None:
    with Loader(name, socket=server.socket) as loader:
        assert sum(len(b[1]) for b in loader) == LENGTH


def _pss_with(admin: Client, server: Server, ds: str, num_workers: int) -> int:
    """The server tree's PSS with a loader of ``num_workers`` over ``ds`` that has read
    one epoch (each of its workers a share of it)."""
    name = f"{ds}-{num_workers}"
    admin.create_loader(name, dataset=ds, batch_size=16, num_workers=num_workers)
    _epoch(server, name)
    pss = _tree_pss(server.pid)
    admin.delete_loader(name)
    return pss


def _per_extra_worker(admin: Client, server: Server, cached: bool) -> tuple[int, int]:
    """(tree PSS with one worker, what a second worker adds), over a filled cache."""
    ds = f"pss-{int(cached)}"
    admin.create_dataset(ds, "python", PARAMS, cache={} if cached else None)
    _pss_with(admin, server, ds, 1)  # fills the cache
    one = _pss_with(admin, server, ds, 1)
    two = _pss_with(admin, server, ds, 2)
    admin.delete_dataset(ds)
    return one, two - one


@pytest.mark.serial  # the PSS of a server's process tree
def test_a_worker_more_costs_the_same_pss_with_a_cache(
    make_server: Callable[..., Server],
) -> None:
    server = make_server()
    server.start()
    with server.client() as admin:
        base_one, base_extra = _per_extra_worker(admin, server, cached=False)
        one, extra = _per_extra_worker(admin, server, cached=True)
    server.stop()
    cache = LENGTH * WIDTH * 4
    print(f"PSS per extra worker: {extra / MiB:.1f} MiB cached, {base_extra / MiB:.1f} uncached")
    # the second worker maps the 100 MiB it reads: it adds its own pages, not a copy
    assert extra < base_extra + 8 * MiB, (extra / MiB, base_extra / MiB)
    # and the cache is counted once, with one worker as with two
    print(f"the cache's pages in the tree's PSS: {(one - base_one) / MiB:.1f} MiB")
    assert 0.8 * cache < one - base_one < 1.5 * cache, (one - base_one) / MiB


@pytest.mark.parametrize("num_workers", [0, 2])
def test_deleting_a_cached_dataset_gives_its_memory_back(
    admin: Client, server: Server, num_workers: int
) -> None:
    """Its region is unmapped and closed in the server, its zygote and workers at once,
    not when a garbage collection gets to it (each cache is its whole dataset's size)."""
    ds, name = unique("gone"), unique("l")
    admin.create_dataset(ds, "python", PARAMS, cache={})
    admin.create_loader(name, dataset=ds, batch_size=16, num_workers=num_workers)
    _epoch(server, name)
    _epoch(server, name)  # hits, read through the region
    assert cache_holders(server.pid, ds)
    admin.delete_loader(name)
    admin.delete_dataset(ds)
    wait_for(lambda: not cache_holders(server.pid, ds), f"no process holding {ds}'s cache", 10)
