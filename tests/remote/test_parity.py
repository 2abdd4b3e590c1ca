"""Remote datasets give DataLoader's batches over a local copy of the same files."""

from __future__ import annotations

import pytest

from bench.references import MemmapTokens
from pinfeed import Client
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
