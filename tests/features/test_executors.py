"""Executors behind the one seam (``engine/producers/executor.py``): ``thread`` makes
DataLoader's batches with threads of the server, changes its thread count live without
losing, repeating or reordering a batch, and refuses with the reason what it cannot
serve; an unknown executor is a 422 naming the ones there are."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, InvalidRequest, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.helpers import assert_epochs_same, unique

PARAMS: dict[str, Any] = {
    "length": 90,
    "seed": 4,
    "fields": [{"shape": [3, 8], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 9}],
}


def _reference(server: Server, epochs: int) -> list[list[Any]]:
    ds = build_dataset("synthetic", PARAMS, DatasetContext(server.data_root))
    dl = DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    return [list(dl) for _ in range(epochs)]


def _thread_loader(admin: Client, workers: int) -> str:
    ds = unique("threads")
    admin.create_dataset(ds, "synthetic", PARAMS)
    name = unique("threads")
    admin.create_loader(
        name, dataset=ds, batch_size=8, shuffle=True, seed=3, num_workers=workers, executor="thread"
    )
    return name


def _copy(batch: Any) -> Any:
    return [t.clone() for t in batch]


def test_thread_executor_gives_dataloaders_batches(admin: Client, server: Server) -> None:
    name = _thread_loader(admin, 2)
    with Loader(name, socket=server.socket) as loader:
        got = [[_copy(b) for b in loader] for _ in range(3)]
    assert_epochs_same(got, _reference(server, 3))
    assert admin.loader(name)["num_workers"] == 2
    admin.delete_loader(name)


def test_thread_count_changes_live(admin: Client, server: Server) -> None:
    name = _thread_loader(admin, 1)
    at = {2: 3, 5: 0, 9: 2, 14: 1}  # after that many batches: that many threads
    got: list[list[Any]] = []
    seen = 0
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            got.append([])
            for batch in loader:
                got[-1].append(_copy(batch))
                seen += 1
                if seen in at:
                    assert admin.patch_loader(name, num_workers=at[seen])["num_workers"] == at[seen]
    assert_epochs_same(got, _reference(server, 2))
    assert seen == 24  # 12 batches an epoch: the loop cannot pass empty
    admin.delete_loader(name)


def test_thread_executor_refuses_a_dataset_that_may_draw_rng(admin: Client) -> None:
    ds = unique("threads-py")
    admin.create_dataset(ds, "python", {"factory": "tests.fixtures.datasets:Flaky"})
    with pytest.raises(InvalidRequest, match="executor 'thread' serves datasets that draw no"):
        admin.create_loader(unique("threads"), dataset=ds, num_workers=2, executor="thread")


def test_an_unknown_executor_names_the_ones_there_are(admin: Client) -> None:
    ds = unique("threads-x")
    admin.create_dataset(ds, "synthetic", PARAMS)
    with pytest.raises(InvalidRequest, match=r"no executor 'gpu'; one of \['local', 'ray', "):
        admin.create_loader(unique("threads"), dataset=ds, num_workers=2, executor="gpu")
