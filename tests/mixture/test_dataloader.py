"""``pinfeed.Mixture`` and ``pinfeed.Packed`` through ``pinfeed.DataLoader`` (the
script's objects, shipped to the server and run in its workers) and through torch's
DataLoader: the same batches, hence the same sequence of source choices, at
``num_workers`` 0 and 2, epoch after epoch (``set_epoch``), and across a resume
mid-epoch in a new loader."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import pinfeed
from pinfeed import packing
from tests.conftest import Server
from tests.helpers import assert_same


class Ids(Dataset[Any]):
    """Source s: sample i is (s, i), so a batch says where each sample came from."""

    def __init__(self, source: int, n: int) -> None:
        self.source, self.n = source, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([self.source, i])


class Docs(Dataset[Any]):
    """Token documents of seeded lengths; ``lengths`` known without a read."""

    def __init__(self, seed: int, n: int) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(1, 40, size=n).tolist()
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Any:
        return torch.arange(self.lengths[i]) + 1000 * self.seed + 100 * (i % 7)


def _mixture() -> pinfeed.Mixture:
    return pinfeed.Mixture([Ids(0, 70), Ids(1, 25), Ids(2, 9)], [0.6, 0.3, 0.1], samples=150)


def _packed_mixture() -> pinfeed.Mixture:
    sources = [
        pinfeed.Packed(Docs(s, 60), 32, mode=m, eos=7) for s, m in ((1, "greedy"), (2, "best_fit"))
    ]
    return pinfeed.Mixture(sources, [0.7, 0.3], samples=40, rule="quota")


def _epochs(loader: Any, dataset: Any, epochs: int) -> list[list[Any]]:
    out = []
    for e in range(epochs):
        dataset.set_epoch(e)
        out.append(
            [
                {k: v.clone() for k, v in b.items()} if isinstance(b, dict) else b.clone()
                for b in loader
            ]
        )
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_through_pinfeed_dataloader_is_torchs(server: Server, workers: int) -> None:
    ref_ds, ds = _mixture(), _mixture()
    want = _epochs(TorchDataLoader(ref_ds, batch_size=16, num_workers=workers), ref_ds, 2)
    loader = pinfeed.DataLoader(ds, batch_size=16, num_workers=workers, socket=server.socket)
    got = _epochs(loader, ds, 2)
    assert_same(got, want)
    # the sources drawn are the rule's, at every num_workers
    for e, batches in enumerate(got):
        sources = torch.cat(batches)[:, 0].numpy()
        assert np.array_equal(sources, ref_ds.mixing.choices(0, e))


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_mixture_through_pinfeed_dataloader_is_torchs(server: Server, workers: int) -> None:
    ref_ds, ds = _packed_mixture(), _packed_mixture()
    kwargs: dict[str, Any] = {
        "batch_size": 4,
        "num_workers": workers,
        "collate_fn": packing.collate,
    }
    want = _epochs(TorchDataLoader(ref_ds, **kwargs), ref_ds, 2)
    got = _epochs(pinfeed.DataLoader(ds, socket=server.socket, **kwargs), ds, 2)
    assert_same(got, want)
    batch = got[0][0]
    assert batch["input_ids"].shape == (4, 32) and batch["cu_seqlens"][-1] == 4 * 32


def test_a_mixture_resumes_mid_epoch_in_a_new_loader(server: Server) -> None:
    ds = _mixture()
    kwargs: dict[str, Any] = {"batch_size": 8, "num_workers": 2, "socket": server.socket}
    ds.set_epoch(1)
    whole = [b.clone() for b in pinfeed.DataLoader(ds, **kwargs)]
    first = pinfeed.DataLoader(ds, **kwargs)
    it = iter(first)
    head = [next(it).clone() for _ in range(5)]
    state = first.state_dict()
    del it
    again = _mixture()
    again.set_epoch(1)
    second = pinfeed.DataLoader(again, **kwargs)
    second.load_state_dict(state)
    rest = [b.clone() for b in second]
    assert_same(head + rest, whole)
