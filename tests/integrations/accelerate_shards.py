"""An Accelerate job of several CPU processes (torchrun, gloo) that ``prepare``s pinfeed
loaders, for test_accelerate's sharding test.

    torchrun --nproc-per-node=N tests/integrations/accelerate_shards.py SOCKET LOADER OUT

Each rank ``prepare``s, with its model and optimizer: a ``pinfeed.DataLoader`` that
nothing shards, one over a ``DistributedSampler``, the tuned batched read over one
(``sampler=BatchSampler(DistributedSampler)``, ``batch_size=None``), and the named
loader LOADER-{rank} (one a rank, without ``world_size``), and LOADER-group (a consumer
group that splits its batches). It records the warnings
each ``prepare`` gave, and two epochs of the ``DistributedSampler`` loader beside
torch's DataLoader on the same objects, under ``set_epoch``, in ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import pinfeed


def prepared(accelerator: Accelerator, loader: Any) -> list[str]:
    """``prepare(model, optimizer, loader)``, as a script does (a named ``Loader``, no
    DataLoader to Accelerate's ``prepare``: ``prepare_data_loader(loader)``, the route
    that tracks its state); the warnings it gave."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if isinstance(loader, pinfeed.Loader):
            same = accelerator.prepare_data_loader(loader)
        else:
            _, _, same = accelerator.prepare(model, opt, loader)
    assert same is loader
    return [str(w.message) for w in caught if str(w.message).startswith("Accelerate hands")]


def main() -> None:
    socket, name, out = sys.argv[1:4]
    accelerator = Accelerator(cpu=True)
    n, rank = accelerator.num_processes, accelerator.process_index
    ds = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    result: dict[str, Any] = {"processes": n}

    loader = pinfeed.DataLoader(ds, batch_size=4, shuffle=True, socket=socket, copy=True)
    result["unsharded"] = prepared(accelerator, loader)
    result["again"] = prepared(accelerator, loader)  # warned once a loader
    loader.close()

    def sharded(cls: Any, **extra: Any) -> Any:
        sampler = DistributedSampler(ds, num_replicas=n, rank=rank, shuffle=True, seed=5)
        return cls(ds, batch_size=4, sampler=sampler, num_workers=1, **extra)

    loader = sharded(pinfeed.DataLoader, socket=socket, copy=True)
    torch_loader = sharded(DataLoader)
    result["distributed"] = prepared(accelerator, loader)
    result["epochs"] = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        torch_loader.sampler.set_epoch(epoch)
        result["epochs"].append(([list(b) for b in loader], [list(b) for b in torch_loader]))
    loader.close()

    batches = BatchSampler(DistributedSampler(ds, num_replicas=n, rank=rank), 4, drop_last=False)
    loader = pinfeed.DataLoader(ds, batch_size=None, sampler=batches, socket=socket, copy=True)
    result["tuned"] = prepared(accelerator, loader)
    loader.close()

    with pinfeed.Loader(f"{name}-{rank}", socket=socket) as named:
        result["named"] = prepared(accelerator, named)
    with pinfeed.Loader(f"{name}-group", socket=socket, member=rank) as group:
        result["group"] = prepared(accelerator, group)  # split: sharded
    torch.save(result, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
