"""The objects that stand for DataLoader's ``dataset``, ``sampler`` and
``batch_sampler`` on a ``Loader``, made from what the server said at attach (the
ATTACHED reply, ``pinfeed.protocol.Attached``).

The dataset and the sampler live in the server; these objects report what they are
(name, lengths, shuffle, seed, sharding, epoch) with DataLoader's meaning, and
``sampler.set_epoch`` reaches the loader, so tools that call it (Lightning,
Accelerate) drive pinfeed's epochs. They cannot hand out samples or indices: the
trainer's process has neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from torch.utils.data import Dataset, Sampler

from pinfeed.protocol import Attached


def server_side(what: str) -> NoReturn:
    """Refuse what only the server can do (it has the dataset and the sampler)."""
    raise TypeError(
        f"pinfeed's {what} lives in the server: a trainer cannot read it here. Iterate "
        "the Loader; to start an epoch at batch n (what skip_first_batches does), call "
        "loader.load_state_dict({'epoch': e, 'index': n})"
    )


class RemoteDataset(Dataset[Any]):
    """``loader.dataset``: the server's dataset by name, length and sample structure."""

    def __init__(self, name: str, length: int | None, sample: Any) -> None:
        self.name = name
        self.sample = sample
        self._length = length

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"dataset {self.name!r} (an IterableDataset) has no len()")
        return self._length

    def __getitem__(self, index: int) -> NoReturn:
        server_side(f"dataset {self.name!r}")

    def __repr__(self) -> str:
        return f"RemoteDataset(name={self.name!r}, length={self._length}, sample={self.sample})"


class RemoteSampler(Sampler[int]):
    """``loader.sampler``: what the server's sampler is, with the attributes of the
    sampler DataLoader would have (``SequentialSampler``, ``RandomSampler`` with a
    seeded generator, or ``DistributedSampler``). ``set_epoch`` is ``loader.set_epoch``.
    """

    def __init__(self, info: Attached, set_epoch: Callable[[int], None]) -> None:
        config = info.config
        self.shuffle = config.shuffle
        self.seed = config.seed
        self.drop_last = config.drop_last
        self.num_replicas = config.world_size
        self.rank = config.rank
        self.epoch = info.epoch
        self.num_samples: int | None = info.sampler_length
        self._set_epoch = set_epoch

    def set_epoch(self, epoch: int) -> None:
        self._set_epoch(epoch)  # loader.set_epoch, which sets self.epoch

    def __len__(self) -> int:
        if self.num_samples is None:  # DataLoader's _InfiniteConstantSampler has no len
            raise TypeError("an IterableDataset's sampler has no len()")
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        server_side("sampler")

    def __repr__(self) -> str:
        kind = "Random" if self.shuffle else "Sequential"
        if self.num_replicas is not None:
            kind = f"Distributed(rank={self.rank}, num_replicas={self.num_replicas})"
        return f"RemoteSampler({kind}, seed={self.seed}, samples={self.num_samples})"


class RemoteBatchSampler(Sampler[list[int]]):
    """``loader.batch_sampler``: ``BatchSampler(loader.sampler, batch_size, drop_last)``."""

    def __init__(self, sampler: RemoteSampler, batch_size: int, batches: int | None) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = sampler.drop_last
        self._batches = batches

    def __len__(self) -> int:
        if self._batches is None:
            raise TypeError("an IterableDataset's batch sampler has no len()")
        return self._batches

    def __iter__(self) -> Iterator[list[int]]:
        server_side("batch sampler")
