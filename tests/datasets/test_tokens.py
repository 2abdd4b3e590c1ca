"""The ``tokens`` kind: nanoGPT/Megatron windows over a flat token file, its checks,
and parity with a ``np.memmap`` Dataset under DataLoader (``bench.references``, the
W6 benchmark's reference too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bench import data
from bench.references import MemmapTokens
from pinfeed import Client, InvalidRequest
from pinfeed_server.datasets import DatasetContext, DatasetError, build_dataset
from tests.conftest import Server
from tests.datasets.parity import GRID, check_parity
from tests.helpers import assert_same, unique


def write_tokens(path: Path, count: int, dtype: str, seed: int = 0) -> np.ndarray:
    high = 50257 if dtype == "uint16" else 200_000  # GPT-2's vocabulary; a larger one
    tokens = np.random.default_rng(seed).integers(0, high, count).astype(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path)
    return tokens


def _build(root: Path, **params: object) -> Any:
    return build_dataset("tokens", dict(params), DatasetContext(root))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize(("count", "seq_len", "stride"), [(100, 8, None), (101, 8, 3), (9, 8, 1)])
def test_windows(tmp_path: Path, dtype: str, count: int, seq_len: int, stride: int | None) -> None:
    tokens = write_tokens(tmp_path / "t.bin", count, dtype)
    ds = _build(tmp_path, path="t.bin", dtype=dtype, seq_len=seq_len, stride=stride)
    ref = MemmapTokens(tmp_path / "t.bin", dtype, seq_len, stride)
    assert len(ds) == len(ref) > 0
    step = stride or seq_len
    for i in range(len(ref)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (seq_len,)
        assert torch.equal(
            x, torch.from_numpy(tokens[i * step : i * step + seq_len].astype("int64"))
        )
        assert torch.equal(y[:-1], x[1:])
        assert_same((x, y), ref[i], f"sample {i}")
    # The last window ends exactly at, or before, the last token.
    last = (len(ref) - 1) * step + seq_len + 1
    assert last <= count < last + step
    with pytest.raises(IndexError):
        ds[len(ref)]


def test_fetch_into_equals_collate(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", 1000, "uint16")
    ds = _build(tmp_path, path="t.bin", seq_len=16, stride=5)
    ref = MemmapTokens(tmp_path / "t.bin", "uint16", 16, 5)
    idx = [3, 0, len(ref) - 1, 3, 17]
    want = next(iter(DataLoader(torch.utils.data.Subset(ref, idx), batch_size=len(idx))))
    out = [torch.full((len(idx), 16), -1, dtype=torch.int64) for _ in range(2)]
    ds.fetch_into(idx, out)
    assert_same(out, want)


@pytest.mark.parametrize(
    ("size", "dtype", "match"),
    [
        (2 * 100 + 1, "uint16", r"t\.bin: size 201 bytes is not a multiple of uint16's 2 bytes"),
        (4 * 100 + 2, "uint32", r"t\.bin: size 402 bytes is not a multiple of uint32's 4 bytes"),
        (0, "uint16", r"t\.bin: 0 tokens, fewer than seq_len \+ 1 = 9"),
        (2 * 8, "uint16", r"t\.bin: 8 tokens, fewer than seq_len \+ 1 = 9"),
    ],
)
def test_refuses_bad_files(tmp_path: Path, size: int, dtype: str, match: str) -> None:
    (tmp_path / "t.bin").write_bytes(b"\x01" * size)
    with pytest.raises(DatasetError, match=match):
        _build(tmp_path, path="t.bin", dtype=dtype, seq_len=8)


def test_refuses_params_and_paths(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_tokens(tmp_path / "outside.bin", 100, "uint16")
    write_tokens(root / "t.bin", 100, "uint16")
    (root / "link.bin").symlink_to(tmp_path / "outside.bin")
    for bad in (
        {"path": "t.bin"},
        {"path": "t.bin", "seq_len": 0},
        {"path": "t.bin", "seq_len": 8, "stride": 0},
        {"path": "t.bin", "seq_len": 8, "dtype": "int64"},
        {"path": "t.bin", "seq_len": 8, "extra": 1},
    ):
        with pytest.raises(DatasetError, match="invalid params"):
            _build(root, **bad)
    for rel in ("../outside.bin", str(tmp_path / "outside.bin"), "link.bin"):
        with pytest.raises(DatasetError, match="outside the data root"):
            _build(root, path=rel, seq_len=8)
    with pytest.raises(DatasetError, match=r"file 'missing\.bin' not found"):
        _build(root, path="missing.bin", seq_len=8)


@pytest.fixture(scope="module")
def token_file(server: Server) -> str:
    rel = f"{unique('tokens')}/train.bin"
    write_tokens(server.data_root / rel, 7 * 6 * 9 + 5, "uint16")
    return rel


def test_http_describes_and_refuses(admin: Client, server: Server, token_file: str) -> None:
    name = unique("tokens")
    info = admin.create_dataset(name, "tokens", {"path": token_file, "seq_len": 9})
    try:
        assert info["length"] == (7 * 6 * 9 + 5 - 10) // 9 + 1
        assert info["sample"] == [
            {"dtype": "int64", "shape": [9]},
            {"dtype": "int64", "shape": [9]},
        ]
        assert admin.dataset(name)["length"] == info["length"]
    finally:
        admin.delete_dataset(name)
    bad = f"{unique('tokens-bad')}.bin"
    (server.data_root / bad).write_bytes(b"\x00" * 11)
    with pytest.raises(InvalidRequest, match=rf"{bad}: size 11 bytes is not a multiple"):
        admin.create_dataset(unique("tokens-bad"), "tokens", {"path": bad, "seq_len": 2})
    with pytest.raises(InvalidRequest, match="outside the data root"):
        admin.create_dataset(unique("tokens-bad"), "tokens", {"path": "../x.bin", "seq_len": 2})


@pytest.mark.parametrize(("batch_size", "shuffle", "num_workers"), GRID)
def test_parity_with_memmap_dataloader(
    admin: Client,
    server: Server,
    token_file: str,
    batch_size: int,
    shuffle: bool,
    num_workers: int,
) -> None:
    name = unique("tokens")
    admin.create_dataset(name, "tokens", {"path": token_file, "seq_len": 9, "stride": 7})
    ref = MemmapTokens(server.data_root / token_file, "uint16", 9, 7)
    try:
        check_parity(
            admin,
            server,
            name,
            ref,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
        )
    finally:
        admin.delete_dataset(name)


def test_w6_workload_files(tmp_path: Path) -> None:
    """The benchmark's files and reference: the same samples as the kind."""
    w = data.make_w6(tmp_path, 1 / 32)
    ds = _build(tmp_path, **w.params)
    ref = MemmapTokens(tmp_path / w.params["path"], "uint16", 1024)
    assert len(ds) == len(ref) == w.samples == 512
    assert_same(ds[511], ref[511])
