"""``pinfeed.DataLoader`` without workers, over objects that may draw: DataLoader makes
each batch in ``next()``, on the trainer's global RNGs, so pinfeed makes it on the
states the trainer sends then. Once the trainer drew nothing between two batches in a
row, the next batch is made before the trainer asks for it: in a loop that only
iterates, fed ahead of its states and made on the states the last batch left (it stands
only if the trainer's states, sent when it asks for it, are those, else the server makes
it again); in a loop that steps longer than it waits, fed as the batch before arrives, on
the trainer's states then (it stands only if the trainer's states are still those when it
asks, else the trainer makes it itself). These tests hold both: the batches made ahead
(seen through a dataset that logs each read to a file), and DataLoader's batches and RNG
states, batch for batch, when the trainer draws between batches (the batch made ahead
is made again, and no batch is made ahead after that)."""

from __future__ import annotations

import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import pinfeed
from tests.conftest import Server
from tests.helpers import assert_same

BATCH = 4


class Logged(Dataset[Any]):
    """Draws from torch, random and numpy in every sample (an augmentation), and
    appends each index it reads to ``log`` (in the process that reads it)."""

    def __init__(self, log: Path, n: int = 40) -> None:
        self.log = str(log)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return torch.full((2,), float(i)) + torch.rand(2), random.random(), np.random.rand()


def _read(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


def _seed() -> None:
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)


def _epochs(
    cls: Any, log: Path, draw_at: set[tuple[int, int]], step_s: float = 0.0, **extra: Any
) -> Any:
    """Three epochs of a shuffled loader; the trainer draws from its RNGs after the
    batches in ``draw_at`` ((epoch, index)), as a training step on the CPU may, and
    steps ``step_s`` after each batch."""
    _seed()
    loader = cls(
        Logged(log),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        **extra,
    )
    got = []
    for epoch in range(3):
        for index, batch in enumerate(loader):
            got.append([x.clone() if isinstance(x, torch.Tensor) else x for x in batch])
            if (epoch, index) in draw_at:
                torch.rand(3), random.random(), np.random.rand()
            time.sleep(step_s)
    after = (torch.rand(2), random.random(), np.random.rand())
    if isinstance(loader, pinfeed.DataLoader):
        loader.close()
    return got, after


def _same_as_dataloader(
    server: Server, tmp_path: Path, draw_at: set[tuple[int, int]], step_s: float = 0.0
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        want, want_after = _epochs(TorchDataLoader, tmp_path / "torch.log", draw_at)
    got, got_after = _epochs(
        pinfeed.DataLoader, tmp_path / "pinfeed.log", draw_at, step_s, socket=server.socket
    )
    assert len(got) == len(want) == 30
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"batch {i}")
    assert_same(got_after, want_after, "the trainer's RNGs afterwards")


def test_the_same_batches_when_the_trainer_draws_nothing(server: Server, tmp_path: Path) -> None:
    _same_as_dataloader(server, tmp_path, set())


def test_the_same_batches_when_the_trainer_draws_between_batches(
    server: Server, tmp_path: Path
) -> None:
    # Batch (0, 5) was made ahead on the states batch 4 left; the trainer then drew, so
    # it is made again on the trainer's states; later draws meet no batch made ahead.
    _same_as_dataloader(server, tmp_path, {(0, 4), (1, 2), (2, 7)})


def test_the_same_batches_when_a_stepping_trainer_draws_between_batches(
    server: Server, tmp_path: Path
) -> None:
    # A step longer than the wait for a batch: each batch is fed as the one before
    # arrives, on the trainer's states then, across epoch 0 and into epoch 1; batch
    # (1, 5) was, and the trainer then drew, so the trainer makes it itself, on its
    # states, and drops the server's; later draws meet no batch made ahead.
    _same_as_dataloader(server, tmp_path, {(1, 4), (2, 7)}, step_s=0.005)


def _wait_for(log: Path, count: int, timeout: float = 5.0) -> list[int]:
    """The indices read so far, once there are ``count`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while len(read := _read(log)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return read


def test_the_next_batch_is_made_while_the_trainer_steps(server: Server, tmp_path: Path) -> None:
    log = tmp_path / "reads.log"
    loader = pinfeed.DataLoader(Logged(log), batch_size=BATCH, socket=server.socket)
    probed = _read(log)  # what the server read of the dataset as it checked it
    n = len(probed)

    def batches(first: int, last: int) -> list[int]:
        return list(range(first * BATCH, last * BATCH))

    it = iter(loader)
    for _ in range(3):  # two batches in a row with no draw between them arm it
        next(it)
    # Batch 3 is made while the trainer "steps", before it asks for it.
    assert _wait_for(log, n + 4 * BATCH)[n:] == batches(0, 4)
    next(it)
    assert _wait_for(log, n + 5 * BATCH)[n:] == batches(0, 5)
    # The trainer draws: batch 4, made ahead on the states batch 3 left, is made again
    # on the trainer's states when asked for, and nothing is made ahead after that.
    torch.rand(1)
    next(it)
    reads = _wait_for(log, n + 6 * BATCH)
    assert reads[n:] == batches(0, 5) + batches(4, 5)
    time.sleep(0.3)
    assert _read(log) == reads, "a batch was made ahead after the trainer drew"
    next(it)
    assert _read(log)[n:] == batches(0, 5) + batches(4, 6)
    loader.close()
