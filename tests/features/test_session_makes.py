"""Where a loader without workers makes its batches: in its one trainer's session
thread while that trainer is attached (``LoaderEngine.drive``: no batch is handed from
the producer thread to the session), in the producer thread before and after (the warm
queue a trainer finds). The batches are the same either way. A ``pinfeed.DataLoader``'s
session makes them too, between the trainer's FEEDs and RNG states, which come on its
socket, and they are DataLoader's."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import pinfeed
from pinfeed import Client, Loader
from pinfeed.protocol import NEXTS_IN_FLIGHT
from tests.conftest import Server
from tests.helpers import assert_same, unique
from tests.reliability.procs import wait_for

LENGTH = 200
BATCH = 4


def _loader(admin: Client, group_size: int = 1) -> tuple[str, int]:
    ds, name = unique("madein"), unique("madein")
    admin.create_dataset(ds, "python", {"factory": "tests.fixtures.datasets:MadeIn"})
    admin.create_loader(name, dataset=ds, batch_size=BATCH, num_workers=0, group_size=group_size)
    total = admin.loader(name)["slots"]["total"]
    wait_for(lambda: admin.loader(name)["slots"]["ready"] >= 1, "the warm queue")
    return name, total


def _made(loader: Loader, batches: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for batch in loader:
        out.append(batch.clone())
        if len(out) == batches:
            break
    return out


def test_an_attached_trainers_session_makes_its_batches(admin: Client, server: Server) -> None:
    name, total = _loader(admin)
    epochs: list[list[torch.Tensor]] = []
    with Loader(name, socket=server.socket, timeout=60) as loader:
        for _ in range(2):
            epochs.append([batch.clone() for batch in loader])
    for got in epochs:
        assert torch.equal(torch.cat(got)[:, 0], torch.arange(LENGTH))  # DataLoader's order
    flags = torch.cat([torch.cat(got)[:, 1] for got in epochs]).view(-1, BATCH)[:, 0]
    # The warm queue (at most the ring's slots), made before the trainer came, came from
    # the producer thread; after that, the trainer's session made every batch.
    assert flags[0], "the warm queue was not the producer thread's"
    assert not flags[total:].any(), f"made in the producer thread: {flags.nonzero().view(-1)}"
    admin.delete_loader(name)


def test_the_next_trainer_goes_on_from_a_warm_queue(admin: Client, server: Server) -> None:
    name, total = _loader(admin)
    with Loader(name, socket=server.socket, timeout=60) as loader:
        first = _made(loader, 3 * total)
    assert not torch.stack(first)[total:, 0, 1].any()
    # Gone: a batch is ready for the next trainer (made ahead by the session before it
    # left, or by the producer thread after: which depends on when the trainer left).
    wait_for(lambda: admin.loader(name)["slots"]["ready"] >= 1, "a batch made ahead")
    with Loader(name, socket=server.socket, timeout=60) as loader:
        second = _made(loader, total)
    # The next trainer goes on where this one stopped (the batches its NEXTs in flight
    # were answered with went with it), in order.
    before, after = torch.cat(first)[:, 0], torch.cat(second)[:, 0]
    assert torch.equal(before, torch.arange(len(before)))
    start = int(after[0])
    assert len(before) <= start <= len(before) + NEXTS_IN_FLIGHT * BATCH
    assert torch.equal(after, torch.arange(start, start + len(after)))
    admin.delete_loader(name)


def test_a_group_keeps_the_producer_thread(admin: Client, server: Server) -> None:
    """Two members free slots from two threads: the batches stay the producer thread's."""
    name, _ = _loader(admin, group_size=2)
    with (
        Loader(name, socket=server.socket, timeout=60) as a,
        Loader(name, socket=server.socket, timeout=60) as b,
    ):
        ia, ib = iter(a), iter(b)
        got = [(next(ia).clone(), next(ib).clone()) for _ in range(10)]
    for x, y in got:
        assert torch.equal(x, y)  # broadcast: both members get every batch
        assert x[:, 1].all()
    admin.delete_loader(name)


class Drawn(Dataset[Any]):
    """Sample ``i``: ``(i, 1 where the server's producer thread made it, else 0)`` and a
    draw from torch's global RNG (an augmentation: the batch is made on the trainer's
    RNG states)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> Any:
        producer = threading.current_thread().name.startswith("pinfeed-produce-")
        return torch.tensor([i, int(producer)]), torch.rand(())


class Listed(torch.utils.data.Sampler[int]):
    """A sampler of the script's own (no feeding ahead: each batch on its states)."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self) -> Any:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def _epochs(cls: Any, sampler: str, **extra: Any) -> list[list[torch.Tensor]]:
    torch.manual_seed(5)
    if sampler == "shuffle":  # torch's: fed ahead of the RNG states once none are drawn
        args: dict[str, Any] = {"shuffle": True, "generator": torch.Generator().manual_seed(3)}
    else:
        args = {"sampler": Listed([(7 * i) % 48 for i in range(48)])}
    loader = cls(Drawn(), batch_size=BATCH, **args, **extra)
    got = [[x.clone() for x in batch] for _ in range(3) for batch in loader]
    if isinstance(loader, pinfeed.DataLoader):
        loader.close()
    return got


@pytest.mark.parametrize("sampler", ["shuffle", "own"])
def test_a_dataloaders_session_makes_its_batches(server: Server, sampler: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        want = _epochs(TorchDataLoader, sampler)
    got = _epochs(pinfeed.DataLoader, sampler, socket=server.socket)
    assert len(got) == len(want) == 36
    made = torch.stack([g[0][:, 1] for g in got])
    # DataLoader makes them in the trainer: no flag. The first batch of the loader may
    # be made before the trainer's session drives; after it, the session made each.
    assert not made[1:].any(), f"made in the producer thread: {made.any(1).nonzero().view(-1)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g[1:], w[1:], f"batch {i}'s draws")
        assert torch.equal(g[0][:, 0], w[0][:, 0]), f"batch {i}'s indices"
