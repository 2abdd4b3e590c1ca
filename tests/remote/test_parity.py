"""Remote datasets give DataLoader's batches over a local copy of the same files."""

from __future__ import annotations

import re

import httpx
import pytest
from typer.testing import CliRunner

from bench.references import MemmapTokens
from pinfeed import Client, InvalidRequest, Loader
from pinfeed_server.cli import app
from tests.datasets.parity import check_parity
from tests.datasets.test_tokens import write_tokens
from tests.helpers import unique
from tests.launcher import Server
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

TOKENS = 7 * 6 * 9 * 40 + 5  # ~30 KB of uint16: several 64 KB blocks at uint32? no: one
GRID = [
    pytest.param(bs, sh, nw, id=f"bs{bs}-{sh}-nw{nw}")
    for bs, sh, nw in ((7, True, 0), (7, True, 2), (1, False, 2))
]


@pytest.fixture(scope="module")
def token_url(remote_server: Server, s3: S3Server) -> str:
    rel = f"{unique('tokens')}/train.bin"
    write_tokens(remote_server.data_root / rel, 200_000, "uint16")
    s3.put("pinfeed", rel, (remote_server.data_root / rel).read_bytes())
    return rel


@pytest.mark.parametrize(("batch_size", "shuffle", "num_workers"), GRID)
def test_tokens(
    admin: Client,
    remote_server: Server,
    token_url: str,
    link: FaultProxy,
    batch_size: int,
    shuffle: bool,
    num_workers: int,
) -> None:
    name = unique("rtokens")
    admin.create_dataset(
        name, "tokens", {"path": f"s3://pinfeed/{token_url}", "seq_len": 900, "stride": 700}
    )
    ref = MemmapTokens(remote_server.data_root / token_url, "uint16", 900, 700)
    try:
        check_parity(
            admin,
            remote_server,
            name,
            ref,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
        )
    finally:
        admin.delete_dataset(name)


def test_once_per_node_and_seen(
    admin: Client, remote_server: Server, token_url: str, link: FaultProxy
) -> None:
    """Two loaders over one remote dataset, two epochs each: the store sends its bytes
    about once (counted by the proxy), and the node's counts say so."""
    url = f"s3://pinfeed/{token_url}"
    name = unique("ronce")
    admin.create_dataset(name, "tokens", {"path": url, "seq_len": 900, "stride": 900})
    size = (remote_server.data_root / token_url).stat().st_size
    before = link.counts.bytes
    loaders = [unique("ronce-l") for _ in range(2)]
    try:
        for lname, nw in zip(loaders, (0, 2), strict=True):
            admin.create_loader(lname, dataset=name, batch_size=5, shuffle=True, num_workers=nw)
        for lname in loaders:
            with Loader(lname, socket=remote_server.socket) as loader:
                for _ in range(2):
                    assert sum(1 for _ in loader) == len(loader)
        fetched = link.counts.bytes - before
        # the earlier tests' blocks of this file are in the cache: at most one copy more
        assert fetched <= 1.05 * size, (fetched, size)
        node = httpx.get(remote_server.url + "/v1/node").json()["remote"]
        assert node["store"]["requests"] >= 1 and node["cache"]["held_bytes"] >= size
        seen = {n: node["loaders"][n] for n in loaders}
        assert all(c["hits"] + c["misses"] > 0 for c in seen.values()), seen
        metrics = httpx.get(remote_server.url + "/metrics").text
        assert "pinfeed_remote_bytes_total" in metrics
        assert f'pinfeed_remote_loader_hits_total{{loader="{loaders[0]}"}}' in metrics
    finally:
        for lname in loaders:
            admin.delete_loader(lname)
        admin.delete_dataset(name)


def test_allow_list_and_missing(admin: Client) -> None:
    with pytest.raises(InvalidRequest, match="PINFEED_REMOTE_ALLOW"):
        admin.create_dataset(unique("rno"), "tokens", {"path": "s3://other/x.bin", "seq_len": 4})
    with pytest.raises(InvalidRequest, match=r"s3://pinfeed/nope/x\.bin.*no such object"):
        admin.create_dataset(
            unique("rno"), "tokens", {"path": "s3://pinfeed/nope/x.bin", "seq_len": 4}
        )


def test_faults_mid_epoch_same_batches(
    admin: Client, remote_server: Server, s3: S3Server, link: FaultProxy
) -> None:
    """503 SlowDown, a reset mid-body and a truncated body while an epoch reads: the
    batches are DataLoader's, and the retries are counted."""
    rel = f"{unique('tfault')}/train.bin"
    write_tokens(remote_server.data_root / rel, 120_000, "uint16", seed=3)
    s3.put("pinfeed", rel, (remote_server.data_root / rel).read_bytes())
    name = unique("rfault")
    admin.create_dataset(name, "tokens", {"path": f"s3://pinfeed/{rel}", "seq_len": 500})
    ref = MemmapTokens(remote_server.data_root / rel, "uint16", 500, 500)
    before = httpx.get(remote_server.url + "/v1/node").json()["remote"]["store"]["retries"]
    for fault in ("503", "reset", "truncate", "503"):
        link.inject(fault, path=f"/pinfeed/{rel}")  # type: ignore[arg-type]
    try:
        check_parity(admin, remote_server, name, ref, batch_size=4, shuffle=True, num_workers=2)
        assert link.pending() == 0
        after = httpx.get(remote_server.url + "/v1/node").json()["remote"]["store"]
        assert after["retries"] - before >= 4 and after["throttled"] >= 2
    finally:
        link.clear()
        admin.delete_dataset(name)


def test_status_shows_the_store(admin: Client, remote_server: Server, token_url: str) -> None:
    """``pinfeed status``: the store's requests, bytes and retries, the object cache,
    and each loader's hits, within 80 columns."""
    name, lname = unique("rstatus"), unique("rstatus-l")
    admin.create_dataset(name, "tokens", {"path": f"s3://pinfeed/{token_url}", "seq_len": 900})
    admin.create_loader(lname, dataset=name, batch_size=5)
    try:
        with Loader(lname, socket=remote_server.socket) as loader:
            assert sum(1 for _ in loader) == len(loader)
        env: dict[str, str | None] = {"COLUMNS": "80", "PINFEED_TOKEN": None}
        result = CliRunner().invoke(app, ["status", "--url", remote_server.url], env=env)
        assert result.exit_code == 0, result.output
        out = result.output
        assert re.search(r"store: \d+ requests, [\d.]+ MB, \d+ retries", out), out
        assert re.search(r"object cache: [\d.]+/[\d.]+ MB, \d+ units", out), out
        assert re.search(rf"{lname}: hits \d+% of \d+", out), out
        assert all(len(line) <= 80 for line in out.splitlines()), out
    finally:
        admin.delete_loader(lname)
        admin.delete_dataset(name)
