"""The store failing while a loader reads it: an object replaced mid-epoch, the
endpoint down (at registration, mid-epoch, past the retry budget, at a server's
start) and back; the object cache kept across a server restart."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.utils.data import DataLoader

from bench.references import MemmapTokens
from pinfeed import Client, Loader, SampleError
from tests.datasets.parity import check_parity, own
from tests.datasets.test_tokens import write_tokens
from tests.helpers import assert_same, unique
from tests.launcher import Server
from tests.remote.conftest import remote_env
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

SEQ = 500  # tokens a sample: 1 KB of uint16, 64 a 64 KB block


def _tokens(server: Server, s3: S3Server, prefix: str, count: int, seed: int = 0) -> str:
    """A token file under the server's data root and in the store; its key."""
    rel = f"{prefix}/train.bin"
    write_tokens(server.data_root / rel, count, "uint16", seed=seed)
    s3.put("pinfeed", rel, (server.data_root / rel).read_bytes())
    return rel


def _reference(server: Server, rel: str) -> MemmapTokens:
    return MemmapTokens(server.data_root / rel, "uint16", SEQ, SEQ)


def _node(server: Server) -> dict[str, Any]:
    remote: dict[str, Any] | None = httpx.get(server.url + "/v1/node").json()["remote"]
    return remote or {"store": {"retries": 0}}  # None: no remote dataset yet


@pytest.fixture()
def own_server(tmp_path: Path, s3: S3Server, proxy: FaultProxy) -> Iterator[Server]:
    """A server of the test's own, through the test's proxy: fetching ahead at most a
    batch (so a replaced object is met mid-epoch), a short retry budget."""
    env = remote_env(
        s3,
        proxy.endpoint,
        PINFEED_REMOTE_AHEAD_BYTES="0",
        PINFEED_REMOTE_RETRY_S="3",
        PINFEED_REMOTE_RETRIES="40",  # the deadline decides, not the draws
        PINFEED_REMOTE_CACHE_DIR=str(tmp_path / "objects"),
    )
    with Server(tmp_path / "srv", env=env) as srv:
        yield srv


def test_object_replaced_mid_epoch_is_a_clear_error_never_a_mixed_batch(
    own_server: Server, s3: S3Server, prefix: str
) -> None:
    """The object is replaced after 10 batches: what the cache holds is the version the
    dataset was registered with (the batches are DataLoader's over it); the first
    block not yet fetched is an error naming the object and what to do, the server
    goes on, and the dataset registered again reads the new version."""
    rel = _tokens(own_server, s3, prefix, 1_000_000)
    url = f"s3://pinfeed/{rel}"
    want = [list(b) for b in DataLoader(_reference(own_server, rel), batch_size=4)]
    with own_server.client() as admin:
        admin.create_dataset("old", "tokens", {"path": url, "seq_len": SEQ})
        admin.create_loader("old", dataset="old", batch_size=4, num_workers=2)
        got: list[Any] = []
        with Loader("old", socket=own_server.socket) as loader:
            it = iter(loader)
            got += [own(next(it)) for _ in range(10)]
            new = _tokens(own_server, s3, prefix, 1_000_000, seed=1)  # the same key
            with pytest.raises(SampleError) as err:
                for batch in it:
                    got.append(own(batch))
        assert 10 <= len(got) < len(want)
        assert_same(got, want[: len(got)])
        assert "replaced in the store" in str(err.value) and rel in str(err.value)
        assert "register the dataset again" in str(err.value)
        admin.create_dataset("new", "tokens", {"path": url, "seq_len": SEQ})
        check_parity(
            admin,
            own_server,
            "new",
            _reference(own_server, new),
            batch_size=4,
            shuffle=True,
            num_workers=0,
            epochs=1,
        )


def test_store_down_at_registration_and_back(
    admin: Client, remote_server: Server, s3: S3Server, link: FaultProxy, prefix: str
) -> None:
    """Registered while the endpoint refuses connections, back 1.5 s later: the
    registration waits it out (retries, counted) and the loader reads the store."""
    rel = _tokens(remote_server, s3, prefix, 40_000)
    before = _node(remote_server)["store"]["retries"]
    link.down()
    threading.Timer(1.5, link.up).start()
    name = unique("rdown")
    admin.create_dataset(name, "tokens", {"path": f"s3://pinfeed/{rel}", "seq_len": SEQ})
    try:
        assert _node(remote_server)["store"]["retries"] > before
        check_parity(
            admin,
            remote_server,
            name,
            _reference(remote_server, rel),
            batch_size=3,
            shuffle=True,
            num_workers=2,
            epochs=1,
        )
    finally:
        link.up()
        admin.delete_dataset(name)


def test_store_down_mid_epoch_and_back(
    own_server: Server, s3: S3Server, proxy: FaultProxy, prefix: str
) -> None:
    """The endpoint goes down for 1.5 s after the first batch, while blocks are in
    flight (a 200 KB/s link): the epoch completes with DataLoader's batches, the outage
    retried."""
    rel = _tokens(own_server, s3, prefix, 300_000, seed=4)
    dl = DataLoader(
        _reference(own_server, rel),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )
    with own_server.client() as admin:
        admin.create_dataset("d", "tokens", {"path": f"s3://pinfeed/{rel}", "seq_len": SEQ})
        proxy.bandwidth = 200e3
        admin.create_loader("d", dataset="d", batch_size=4, shuffle=True, seed=2)
        try:
            with Loader("d", socket=own_server.socket) as loader:
                it = iter(loader)
                got = [own(next(it))]
                proxy.down()
                threading.Timer(1.5, proxy.up).start()
                got += [own(b) for b in it]
            assert_same(got, [list(b) for b in dl])
            assert _node(own_server)["store"]["retries"] > 0
        finally:
            proxy.up()


@pytest.mark.slow
def test_store_down_past_the_retry_budget_then_back(
    own_server: Server, s3: S3Server, proxy: FaultProxy, prefix: str
) -> None:
    """Down longer than PINFEED_REMOTE_RETRY_S (3 s): the batch's error names the store
    and says it kept failing; the server goes on, and once the store is back the same
    loader reads a whole epoch of DataLoader's batches."""
    rel = _tokens(own_server, s3, prefix, 200_000, seed=5)
    want = [list(b) for b in DataLoader(_reference(own_server, rel), batch_size=4)]
    with own_server.client() as admin:
        admin.create_dataset("d", "tokens", {"path": f"s3://pinfeed/{rel}", "seq_len": SEQ})
        proxy.down()  # before the loader's first batch is made (registration read block 0)
        admin.create_loader("d", dataset="d", batch_size=4)
        try:
            with Loader("d", socket=own_server.socket) as loader:
                got: list[Any] = []
                with pytest.raises(SampleError, match="kept failing") as err:
                    for batch in loader:
                        got.append(own(batch))
                assert proxy.endpoint in str(err.value)
                assert_same(got, want[: len(got)])  # those of block 0, in the cache
                proxy.up()
                loader.set_epoch(1)
                assert_same([own(b) for b in loader], want)
        finally:
            proxy.up()


@pytest.mark.slow
def test_cache_kept_across_a_restart_with_the_store_down_at_start(
    own_server: Server, s3: S3Server, proxy: FaultProxy, prefix: str
) -> None:
    """A restarted server finds the object cache its predecessor filled: the store is
    down when it starts (its registry's dataset is listed again once it is back, 1.5 s
    later) and the epoch after the restart fetches no byte of the object."""
    rel = _tokens(own_server, s3, prefix, 150_000, seed=6)
    with own_server.client() as admin:
        admin.create_dataset("d", "tokens", {"path": f"s3://pinfeed/{rel}", "seq_len": SEQ})
        admin.create_loader("d", dataset="d", batch_size=4, shuffle=True, seed=3)
    with Loader("d", socket=own_server.socket) as loader:
        assert sum(1 for _ in loader) == len(loader)
    size = (own_server.data_root / rel).stat().st_size
    assert proxy.counts.bytes >= size
    own_server.stop()
    proxy.down()
    proxy.reset_counts()
    threading.Timer(1.5, proxy.up).start()
    own_server.start()
    try:
        assert _node(own_server)["cache"]["held_bytes"] >= size
        with own_server.client() as admin:
            check_parity(
                admin,
                own_server,
                "d",
                _reference(own_server, rel),
                batch_size=4,
                shuffle=True,
                num_workers=2,
                epochs=1,
            )
        assert proxy.counts.by_method.get("GET", 0) == 0, proxy.counts
    finally:
        proxy.up()
