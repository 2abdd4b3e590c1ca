"""PATCH num_workers/prefetch_factor under a live trainer: no batch lost, repeated or
reordered; changes that need another ring are refused with 409."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Conflict, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.fixtures.trainer import digest
from tests.helpers import unique

PARAMS: dict[str, Any] = {"length": 96, "seed": 2, "fields": [{"shape": [4], "dtype": "float32"}]}


def test_patch_live_keeps_every_batch(admin: Client, server: Server) -> None:
    ds = unique("patch")
    admin.create_dataset(ds, "synthetic", PARAMS)
    name = unique("patch")
    admin.create_loader(
        name, dataset=ds, batch_size=4, shuffle=True, seed=6, num_workers=3, prefetch_factor=2
    )
    ref = DataLoader(
        build_dataset("synthetic", PARAMS, DatasetContext(server.data_root)),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(6),
    )
    want = [digest(b) for _ in range(2) for b in ref]
    got: list[str] = []
    changes = iter(
        [
            {"num_workers": 1},
            {"num_workers": 2, "prefetch_factor": 3},
            {"prefetch_factor": 1},
            {"num_workers": 3},
        ]
    )
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            for i, batch in enumerate(loader):
                got.append(digest(batch))
                if i % 5 == 2 and (change := next(changes, None)):
                    out = admin.patch_loader(name, **change)
                    for key, value in change.items():
                        assert out[key] == value
    assert got == want
    assert admin.loader(name)["num_workers"] == 3
    with pytest.raises(Conflict, match="ring slots"):
        admin.patch_loader(name, num_workers=3, prefetch_factor=4)
    admin.delete_loader(name)
    inline = unique("inline")
    admin.create_loader(inline, dataset=ds, batch_size=4, num_workers=0)
    with pytest.raises(Conflict, match="num_workers=0"):
        admin.patch_loader(inline, num_workers=1)
    admin.delete_loader(inline)
