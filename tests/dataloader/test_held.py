"""DataLoader's batches are the trainer's for as long as it holds them: ``list(loader)``,
a loop that keeps the last batch (Lightning's fetcher a batch ahead), a batch kept for
later. ``pinfeed.DataLoader``'s batches are views into the server's ring, and a slot
goes back to the server only once no tensor of the trainer's holds the batch in it;
where the trainer holds every slot, the ring grows (within the node's budget), and
shrinks again once it lets go. Compared with torch's DataLoader without cloning."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import pinfeed
from pinfeed import InsufficientMemory
from tests.conftest import Server
from tests.helpers import assert_same

WORKERS = [0, 2]


class Rows(Dataset[Any]):
    def __init__(self, n: int = 50, width: int = 2) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((self.width,), i, dtype=torch.int64), {"square": i * i}


@pytest.mark.parametrize("workers", WORKERS)
def test_a_list_of_every_batch(server: Server, workers: int) -> None:
    theirs = list(TorchDataLoader(Rows(), batch_size=4))
    loader = pinfeed.DataLoader(Rows(), batch_size=4, num_workers=workers, socket=server.socket)
    for _ in range(2):
        ours = list(loader)  # no clone: each batch must stay as it came
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert_same(a, b)
        del ours
    loader.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_a_loop_a_batch_behind(server: Server, workers: int) -> None:
    """Lightning's fetcher keeps a batch while it fetches the next (to know the last)."""

    def behind(loader: Any) -> Iterator[Any]:
        it = iter(loader)
        held = next(it)
        for batch in it:
            yield held
            held = batch
        yield held

    theirs = [b for b in TorchDataLoader(Rows(), batch_size=3, shuffle=False)]
    loader = pinfeed.DataLoader(Rows(), batch_size=3, num_workers=workers, socket=server.socket)
    for _ in range(2):
        for got, want in zip(behind(loader), theirs, strict=True):
            assert_same(got, want)
    loader.close()


def test_the_ring_grows_for_what_the_trainer_holds_and_shrinks_after(server: Server) -> None:
    loader = pinfeed.DataLoader(Rows(n=120), batch_size=4, socket=server.socket)
    name = loader.pinfeed_name
    with server.client() as admin:
        kept = list(loader)  # 30 batches held at once
        grown = admin.loader(name)["slots"]["total"]
        assert grown >= 29
        del kept
        for _ in range(2):
            for _batch in loader:  # let go of one by one: the grown slots come back
                pass
        assert admin.loader(name)["slots"]["total"] < grown
    loader.close()


@pytest.fixture()
def small_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"PINFEED_MAX_SHM_BYTES": str(256 << 10)}
    with Server(tmp_path_factory.mktemp("small-shm"), env=env) as srv:
        yield srv


def test_holding_more_than_the_node_has_room_for_says_what_to_do(small_node: Server) -> None:
    loader = pinfeed.DataLoader(
        Rows(n=400, width=1024), batch_size=4, socket=small_node.socket, strict=True
    )
    with pytest.raises(InsufficientMemory, match=r"holds \d+ batches.*batch\.clone\(\)"):
        list(loader)
    loader.close()
