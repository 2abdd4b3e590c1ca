"""``executor: "ray"`` on a real multi-node Ray cluster (head, two worker nodes, the
server's node, each in its own network namespace): DataLoader's batches, and faults.

The order matters (one cluster per module, Ray on two shared cores is slow): parity
first, then an actor SIGKILLed and a worker node stopped (restarted after), and last
the head lost and brought back.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Conflict, Loader, LoaderFailed
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.datasets.test_images import make_tree
from tests.fixtures.collate import Tokens, pad_collate
from tests.helpers import assert_same, unique
from tests.ray.cluster import NetCluster, NetServer

# Each test includes the module's cluster start (~1 min on 2 shared cores) when it runs alone.
pytestmark = pytest.mark.timeout(900)

LENGTH = 90
EPOCHS = 2
BATCH = 7


def _register(srv: NetServer, kind: str, params: dict[str, Any]) -> tuple[str, Any]:
    name = unique(f"ray-{kind}")
    with srv.client() as c:
        c.create_dataset(name, kind, params)
    ctx = DatasetContext(srv.data_root, ("tests.fixtures",))
    return name, build_dataset(kind, params, ctx)


def _npy(srv: NetServer) -> tuple[str, Any]:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 255, (LENGTH, 3, 4, 4), generator=g, dtype=torch.uint8)
    np.save(srv.data_root / "rx.npy", x.numpy().astype(np.float32))
    np.save(srv.data_root / "ry.npy", np.arange(LENGTH, dtype=np.int64))
    return _register(srv, "npy", {"paths": {"image": "rx.npy", "label": "ry.npy"}})


def _reference(ds: Any, seed: int, num_workers: int = 2, **kw: Any) -> list[list[Any]]:
    loader = DataLoader(
        ds,
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    return [list(loader) for _ in range(EPOCHS)]


def _loader(srv: NetServer, dataset: str, seed: int, **kw: Any) -> str:
    name = unique("ray-loader")
    with srv.client() as c:
        c.create_loader(
            name,
            dataset=dataset,
            batch_size=BATCH,
            shuffle=True,
            seed=seed,
            num_workers=2,
            executor="ray",
            **kw,
        )
    return name


def _wait_state(srv: NetServer, name: str, states: set[str], timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    with srv.client() as c:
        while True:
            info = c.loader(name)
            if info["state"] in states or time.monotonic() > deadline:
                return info
            time.sleep(0.5)  # polls the control plane: nothing to wait on across processes


def _check(srv: NetServer, name: str, want: list[list[Any]], fault: Any = None) -> None:
    """Every epoch's batches equal ``want``'s; ``fault(batch_number)`` runs after each
    batch received (a kill mid-epoch)."""
    assert _wait_state(srv, name, {"ready", "failed"})["state"] == "ready"
    n = 0
    with Loader(name, socket=srv.socket, timeout=300, copy=True) as loader:
        for epoch in range(EPOCHS):
            got = list(_each(loader, fault, n))
            n += len(got)
            assert len(got) == len(want[epoch]), f"epoch {epoch}: {len(got)} batches"
            for i, (g, w) in enumerate(zip(got, want[epoch], strict=True)):
                assert_same(g, w, f"epoch {epoch} batch {i}")


def _each(loader: Loader, fault: Any, start: int) -> Any:
    for i, batch in enumerate(loader):
        yield batch
        if fault is not None:
            fault(start + i + 1)


def test_parity_npy(ray_server: NetServer) -> None:
    dataset, ds = _npy(ray_server)
    name = _loader(ray_server, dataset, seed=11)
    _check(ray_server, name, _reference(ds, 11))
    with ray_server.client() as c:
        assert c.loader(name)["executor"] == "ray"
        c.delete_loader(name)


def test_parity_images(ray_server: NetServer) -> None:
    make_tree(ray_server.data_root / "ray-images")
    dataset, ds = _register(ray_server, "images", {"path": "ray-images", "size": 24})
    name = _loader(ray_server, dataset, seed=12)
    _check(ray_server, name, _reference(ds, 12))
    with ray_server.client() as c:
        c.delete_loader(name)


def test_parity_augmentation_streams(ray_server: NetServer) -> None:
    """A dataset that draws from the global RNGs: each actor is DataLoader's worker."""
    dataset, ds = _register(
        ray_server,
        "python",
        {"factory": "tests.fixtures.datasets:Augmented", "kwargs": {"length": LENGTH}},
    )
    name = _loader(ray_server, dataset, seed=13)
    _check(ray_server, name, _reference(ds, 13))
    with ray_server.client() as c:
        c.delete_loader(name)


def test_parity_collate_fn_per_batch_layouts(ray_server: NetServer) -> None:
    """A collate_fn that pads each batch to its longest sequence: every batch has its
    own layout, made by the actors with the local workers' code, as DataLoader's."""
    dataset, ds = _register(
        ray_server,
        "python",
        {"factory": "tests.fixtures.collate:Tokens", "kwargs": {"length": LENGTH}},
    )
    assert isinstance(ds, Tokens)
    name = _loader(ray_server, dataset, seed=14, collate_fn="tests.fixtures.collate:pad_collate")
    _check(ray_server, name, _reference(ds, 14, collate_fn=pad_collate))
    with ray_server.client() as c:
        c.delete_loader(name)


def test_patch_num_workers_live(ray_server: NetServer) -> None:
    """PATCH to one actor mid-epoch (it serves both RNG streams), then to three with a
    deeper prefetch (the ring grows a segment, which the bridge maps before the first
    batch into it): the batches stay DataLoader(num_workers=2)'s. 0 workers is a 409:
    a Ray loader's batches are never made in the server."""
    dataset, ds = _register(
        ray_server,
        "python",
        {"factory": "tests.fixtures.datasets:Augmented", "kwargs": {"length": LENGTH}},
    )
    name = _loader(ray_server, dataset, seed=17)
    assert _wait_state(ray_server, name, {"ready", "failed"})["state"] == "ready"
    with ray_server.client() as c:
        with pytest.raises(Conflict, match="executor 'ray'"):
            c.patch_loader(name, num_workers=0)
        before = c.loader(name)["ring_bytes"]

    def fault(n: int) -> None:
        with ray_server.client() as c:
            if n == 3:
                assert c.patch_loader(name, num_workers=1)["num_workers"] == 1
            if n == 6:
                grown = c.patch_loader(name, num_workers=3, prefetch_factor=4)
                assert grown["num_workers"] == 3

    _check(ray_server, name, _reference(ds, 17), fault)
    with ray_server.client() as c:
        assert (
            c.loader(name)["ring_bytes"] > before
        )  # the ring grew a segment (prefetch 12 > its 6 first slots)
        c.delete_loader(name)


def test_a_new_actor_that_dies_before_it_ran_is_started_again(ray_server: NetServer) -> None:
    """A PATCH to three actors mid-epoch whose new actor's process dies while it builds
    its dataset (as one Ray placed on a stopped node it does not yet know is dead): the
    bridge starts another, and the batches stay DataLoader(num_workers=2)'s."""
    marker = ray_server.data_root / unique("dies-once")
    dataset, ds = _register(
        ray_server,
        "python",
        {
            "factory": "tests.fixtures.datasets:DiesOnce",
            "kwargs": {"marker": str(marker), "length": LENGTH},
        },
    )
    name = _loader(ray_server, dataset, seed=18)
    assert _wait_state(ray_server, name, {"ready", "failed"})["state"] == "ready"

    def fault(n: int) -> None:
        if n == 3:
            marker.touch()  # the next process to build the dataset dies
            with ray_server.client() as c:
                assert c.patch_loader(name, num_workers=3)["num_workers"] == 3

    _check(ray_server, name, _reference(ds, 18), fault)
    assert not marker.exists() and marker.with_name(marker.name + ".taken").exists()
    with ray_server.client() as c:
        assert c.loader(name)["state"] == "ready"
        c.delete_loader(name)


def test_sigkill_an_actor_mid_epoch(cluster: NetCluster, ray_server: NetServer) -> None:
    """Its batches are made again by a replacement, with the same augmentations (the
    dead worker's RNG stream restored): nothing lost, repeated or reordered."""
    dataset, ds = _register(
        ray_server,
        "python",
        {"factory": "tests.fixtures.datasets:Augmented", "kwargs": {"length": LENGTH}},
    )
    name = _loader(ray_server, dataset, seed=14)
    _wait_state(ray_server, name, {"ready", "failed"})
    killed: list[int] = []

    def fault(n: int) -> None:
        if n == 5:
            # This loader's two (an earlier loader's killed actors may still be exiting).
            deadline = time.monotonic() + 30
            while len(pids := cluster.actor_pids()) != 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    _check(ray_server, name, _reference(ds, 14), fault)
    assert killed
    with ray_server.client() as c:
        assert c.loader(name)["worker_restarts"] >= 1
        c.delete_loader(name)


def test_stop_a_worker_node_mid_epoch(cluster: NetCluster, ray_server: NetServer) -> None:
    """Every process of one worker node killed: its actors start on the other node and
    the sequence is intact. The node is started again for the tests after this one."""
    dataset, ds = _npy(ray_server)
    name = _loader(ray_server, dataset, seed=15)
    stopped: list[str] = []

    def fault(n: int) -> None:
        if n == 4:
            node = next(
                w for w in ("w1", "w2") if any(p in cluster.actor_pids() for p in _pids(cluster, w))
            )
            cluster.stop_node(node)
            stopped.append(node)

    try:
        _check(ray_server, name, _reference(ds, 15), fault)
        assert stopped
        with ray_server.client() as c:
            assert c.loader(name)["worker_restarts"] >= 1
            c.delete_loader(name)
    finally:
        for node in stopped:
            cluster.start_node(node)


def _pids(cluster: NetCluster, node: str) -> list[int]:
    return [p.pid for p in cluster.processes(cluster.nodes[node].ns)]


def test_lost_head_fails_the_loader_and_it_recovers(
    cluster: NetCluster, ray_server: NetServer
) -> None:
    """The head gone: the loader is ``failed`` with the reason and the trainer gets
    LoaderFailed (no hang); the cluster back: the loader is ready again and a trainer
    resuming from its state_dict gets the rest of DataLoader's batches."""
    dataset, ds = _npy(ray_server)
    name = _loader(ray_server, dataset, seed=16)
    want = _reference(ds, 16)
    info = _wait_state(ray_server, name, {"ready", "failed"})
    assert info["state"] == "ready", info["failure"]
    got: list[Any] = []
    with Loader(name, socket=ray_server.socket, timeout=300, copy=True) as loader:
        it = iter(loader)
        for _ in range(3):
            got.append(next(it))
        state = loader.state_dict()
        for node in ("head", "w1", "w2", "srv"):
            cluster.stop_node(node)
        with pytest.raises(LoaderFailed, match="Ray"):
            for batch in it:
                got.append(batch)  # what was ready before the loss may still come
    info = _wait_state(ray_server, name, {"failed"}, timeout=60)
    assert info["state"] == "failed"
    assert "Ray" in info["failure"]["detail"], info["failure"]
    for node in ("head", "w1", "w2", "srv"):
        cluster.start_node(node)
    assert _wait_state(ray_server, name, {"ready"}, timeout=240)["state"] == "ready"
    state["index"] = len(got)
    with Loader(name, socket=ray_server.socket, timeout=300, copy=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    for i, (g, w) in enumerate(zip(got + rest, want[0], strict=True)):
        assert_same(g, w, f"batch {i}")
