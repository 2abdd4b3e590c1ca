"""Parity with a reference Dataset under DataLoader, through a real server and
``pinfeed.Loader``: the grid every file-format kind is checked on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.helpers import assert_same, unique

# batch size, shuffle, num_workers: sizes 1 and 7, shuffle on and off, 0 and 2 workers.
GRID = [
    pytest.param(bs, shuffle, nw, id=f"bs{bs}-{'shuffle' if shuffle else 'seq'}-nw{nw}")
    for bs in (1, 7)
    for shuffle in (False, True)
    for nw in (0, 2)
]


def own(batch: Any) -> Any:
    """A copy that outlives the slot it was viewed in."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: own(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(own(v) for v in batch)
    return batch


def check_parity(
    admin: Client,
    server: Server,
    dataset: str,
    reference: Any,
    *,
    batch_size: int,
    shuffle: bool,
    num_workers: int,
    epochs: int = 2,
    convert: Callable[[Any], Any] = lambda b: b,
    **loader: Any,
) -> int:
    """Same batches in the same order for ``epochs`` epochs; returns the batches seen.
    ``convert`` maps a reference batch to the structure the kind yields (e.g. a dict
    batch to the tuple that ``columns`` asked for)."""
    name = unique("parity")
    admin.create_loader(
        name,
        dataset=dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=11,
        num_workers=num_workers,
        **loader,
    )
    ref = DataLoader(
        reference,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(11),
        num_workers=num_workers,
        **loader,
    )
    seen = 0
    try:
        with Loader(name, socket=server.socket) as got_loader:
            for epoch in range(epochs):
                want = [convert(b) for b in ref]
                got = [own(b) for b in got_loader]
                assert len(got) == len(want) > 0, f"epoch {epoch}"
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert_same(g, w, f"epoch {epoch} batch {i}")
                seen += len(got)
    finally:
        admin.delete_loader(name)
    return seen
