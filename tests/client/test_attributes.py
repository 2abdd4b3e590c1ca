"""DataLoader's attributes on a Loader: the same values, with DataLoader's meaning, as
the DataLoader that yields the same batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.helpers import register_synthetic, unique

PARAMS: dict[str, Any] = {
    "length": 30,
    "seed": 1,
    "fields": [{"shape": [3, 2], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 4}],
}


@pytest.fixture(scope="module")
def dataset(server: Server) -> tuple[str, Any]:
    return register_synthetic(server, PARAMS, "attrs")


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"shuffle": True, "seed": 5, "num_workers": 2, "prefetch_factor": 3, "drop_last": True},
        {"num_workers": 1, "persistent_workers": True},
        {"shuffle": True, "seed": 5, "rank": 1, "world_size": 4, "batch_size": 4},
    ],
)
def test_dataloader_attributes(
    admin: Client, server: Server, dataset: tuple[str, Any], kw: dict[str, Any]
) -> None:
    name, ds = dataset
    loader_name = unique("attrs")
    admin.create_loader(loader_name, dataset=name, **{"batch_size": 7, **kw})
    shuffle = kw.get("shuffle", False)
    if "world_size" in kw:
        sampler: Any = DistributedSampler(
            ds, num_replicas=kw["world_size"], rank=kw["rank"], shuffle=shuffle, seed=kw["seed"]
        )
    else:
        sampler = RandomSampler(ds) if shuffle else SequentialSampler(ds)
    workers = kw.get("num_workers", 0)
    ref = DataLoader(
        ds,
        batch_size=kw.get("batch_size", 7),
        sampler=sampler,
        drop_last=kw.get("drop_last", False),
        num_workers=workers,
        prefetch_factor=kw.get("prefetch_factor") if workers else None,
        persistent_workers=kw.get("persistent_workers", False),
    )
    with Loader(loader_name, socket=server.socket, timeout=None) as loader:
        for attr in ("batch_size", "drop_last", "num_workers", "prefetch_factor"):
            assert getattr(loader, attr) == getattr(ref, attr), attr
        assert loader.persistent_workers == ref.persistent_workers
        assert loader.pin_memory is False and loader.timeout == ref.timeout == 0
        assert loader.collate_fn is torch.utils.data.default_collate
        assert loader.dataset.name == name and len(loader.dataset) == len(ds) == 30
        assert loader.dataset.sample == [
            {"dtype": "float32", "shape": [3, 2]},
            {"dtype": "int64", "shape": []},
        ]
        assert len(loader.sampler) == len(sampler)
        assert loader.sampler.shuffle == shuffle
        assert loader.sampler.num_replicas == kw.get("world_size")
        assert loader.batch_sampler.batch_size == ref.batch_size
        assert len(loader.batch_sampler) == len(ref.batch_sampler) == len(loader) == len(ref)
        if shuffle and "world_size" not in kw:
            # The generator DataLoader needs for the same batches.
            same = DataLoader(ds, batch_size=7, shuffle=True, generator=loader.generator)
            assert loader.generator is not None
            got, want = next(iter(loader)), next(iter(same))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            assert loader.generator is None
        for attr in ("batch_size", "dataset", "sampler", "num_workers"):
            with pytest.raises(AttributeError):
                setattr(loader, attr, None)
        with pytest.raises(TypeError, match=r"lives in the server.*load_state_dict"):
            loader.dataset[0]
        with pytest.raises(TypeError, match="lives in the server"):
            iter(loader.sampler)
    admin.delete_loader(loader_name)
