"""The tuned reads a performance engineer writes, through torch's ``DataLoader`` and
``pinfeed.DataLoader`` on the same Dataset object: ``batch_size=None`` over a
``BatchSampler`` (each index list read whole, ``dataset[indices]``; a ``TensorDataset``
so read is gathered straight into the slot, ``engine/collate.py``'s ``_gather_listed``)
and a dataset's ``__getitems__`` under automatic batching. Shuffled, three epochs, at
0, 1 and 2 workers and with persistent workers: batch for batch ``torch.equal``, and the
trainer's RNGs alike after (``test_parity.check``). Every row of every table differs, so
a batch of the wrong rows, or of the right rows in the wrong order, fails."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, RandomSampler, TensorDataset

from tests.conftest import Server
from tests.dataloader.test_parity import Make, check

N = 61  # not a multiple of the batch size: a short last batch unless drop_last
B = 8


class RowsByList(Dataset[Any]):
    """``__getitem__`` takes a batch's index list and returns its rows as one tensor."""

    def __init__(self) -> None:
        self.table = torch.arange(N * 3, dtype=torch.int64).reshape(N, 3) * 7 + 1

    def __len__(self) -> int:
        return N

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        return self.table[indices]


class ArrayByList(Dataset[Any]):
    """The same, a numpy array (DataLoader's ``default_convert`` makes it a tensor)."""

    def __init__(self) -> None:
        self.array = np.arange(N * 4, dtype=np.float32).reshape(N, 2, 2) / 3

    def __len__(self) -> int:
        return N

    def __getitem__(self, indices: list[int]) -> np.ndarray:
        return self.array[indices]


class GetItems(Dataset[Any]):
    """A batch read in one ``__getitems__`` (as Hugging Face datasets do); its
    ``__getitem__`` says it was used instead (a 1 where ``__getitems__`` writes a 2)."""

    def __init__(self) -> None:
        self.rows = torch.arange(N * 2, dtype=torch.float64).reshape(N, 2) - 5

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return self.rows[i], 1

    def __getitems__(self, indices: list[int]) -> list[Any]:
        rows = self.rows[indices]
        return [(rows[k], 2 + i) for k, i in enumerate(indices)]


def _tensors() -> TensorDataset:
    g = torch.Generator().manual_seed(8)
    return TensorDataset(
        torch.randn(N, 3, 2, generator=g),
        torch.arange(N, dtype=torch.uint8) * 3,
        torch.arange(N, dtype=torch.int64) * -11,
        torch.rand(N, generator=g, dtype=torch.float64) > 0.5,
    )


# (num_workers, persistent_workers)
CONFIGS = [(0, False), (1, False), (2, False), (2, True)]


@pytest.fixture(params=CONFIGS, ids=["workers0", "workers1", "workers2", "persistent2"])
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    workers, persistent = request.param
    return {"num_workers": workers, "persistent_workers": persistent}


def _tuned(ds: Dataset[Any], drop_last: bool, config: dict[str, Any], seeded: bool) -> Make:
    """``batch_size=None`` over ``BatchSampler(RandomSampler(ds, generator))``, the
    generator seeded alike for each side (``seeded``), else the global RNG's draw."""

    def make(cls: type[Any], extra: dict[str, Any]) -> Any:
        g = torch.Generator().manual_seed(11) if seeded else None
        batches = BatchSampler(RandomSampler(ds, generator=g), B, drop_last)
        return cls(ds, batch_size=None, sampler=batches, **config, **extra)

    return make


@pytest.mark.parametrize("drop_last", [False, True])
def test_index_lists_read_whole(server: Server, config: dict[str, Any], drop_last: bool) -> None:
    for ds in (RowsByList(), ArrayByList()):
        check(server, _tuned(ds, drop_last, config, seeded=True))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_tensordataset_gathered_into_the_slot(
    server: Server, config: dict[str, Any], drop_last: bool
) -> None:
    ds = _tensors()
    check(server, _tuned(ds, drop_last, config, seeded=True))
    # The sampler's seed drawn from the global RNG at each epoch's first next()
    check(server, _tuned(ds, drop_last, config, seeded=False))


@pytest.mark.parametrize("drop_last", [False, True])
def test_getitems_reads_each_batch(server: Server, config: dict[str, Any], drop_last: bool) -> None:
    ds = GetItems()

    def make(cls: type[Any], extra: dict[str, Any]) -> Any:
        g = torch.Generator().manual_seed(12)
        batches = BatchSampler(RandomSampler(ds, generator=g), B, drop_last)
        return cls(ds, batch_sampler=batches, **config, **extra)

    check(server, make)
    # shuffle=True on a generator: DataLoader's own BatchSampler over its RandomSampler
    check(
        server,
        lambda cls, x: cls(
            ds,
            batch_size=B,
            shuffle=True,
            drop_last=drop_last,
            generator=torch.Generator().manual_seed(13),
            **config,
            **x,
        ),
    )
