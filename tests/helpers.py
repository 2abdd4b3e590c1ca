"""Comparison helpers shared by the tests."""

from __future__ import annotations

import itertools
from typing import Any

import torch

_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def smaps_rollup(pid: int) -> dict[str, int]:
    """A process's ``/proc/PID/smaps_rollup`` in bytes: ``Pss``, ``Anonymous``, ..."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def assert_same(got: Any, want: Any, where: str = "batch") -> None:
    """Same nested structure, same container types, tensors equal with equal dtypes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)} is not a tensor"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
        return
    if isinstance(want, tuple) and hasattr(want, "_fields"):
        assert type(got).__name__ == type(want).__name__, f"{where}: {type(got)} != {type(want)}"
        assert got._fields == want._fields
    else:
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_epochs_same(got: list[list[Any]], want: list[list[Any]]) -> None:
    """Epochs of batches: the same number per epoch, each batch ``assert_same``."""
    assert [len(e) for e in got] == [len(e) for e in want]
    for e, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (gb, wb) in enumerate(zip(g, w, strict=True)):
            assert_same(gb, wb, f"epoch {e} batch {i}")


def register_synthetic(server: Any, params: dict[str, Any], prefix: str = "syn") -> tuple[str, Any]:
    """Register a synthetic dataset on ``server``; (its name, the same dataset built here)."""
    from pinfeed_server.datasets import DatasetContext, build_dataset

    name = unique(prefix)
    with server.client() as c:
        c.create_dataset(name, "synthetic", params)
    return name, build_dataset("synthetic", params, DatasetContext(server.data_root))
