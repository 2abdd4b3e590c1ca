"""What a trainer knows about its loader (the ATTACHED reply,
``pinfeed.protocol.Attached``) as DataLoader's attributes, and the objects that stand
for DataLoader's ``dataset``, ``sampler`` and ``batch_sampler``.

The dataset and the sampler live in the server; these objects report what they are
(name, lengths, shuffle, seed, sharding, epoch) with DataLoader's meaning, and
``sampler.set_epoch`` reaches the loader, so tools that call it (Lightning,
Accelerate) drive pinfeed's epochs. They cannot hand out samples or indices: the
trainer's process has neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.utils.data import Dataset, Sampler

from pinfeed.protocol import Attached, AttachedConfig


def _server_side(what: str) -> NoReturn:
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
        _server_side(f"dataset {self.name!r}")

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
        _server_side("sampler")

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
        _server_side("batch sampler")


def _seeded_generator(config: AttachedConfig) -> torch.Generator | None:
    """The generator that makes DataLoader shuffle as this loader does (a new one each
    call: drawing from it changes nothing in the server), or None where DataLoader
    would have none (no shuffle, or DistributedSampler's seed)."""
    if not config.shuffle or config.world_size is not None:
        return None
    return torch.Generator().manual_seed(config.seed)


class DataLoaderAttributes:
    """DataLoader's attributes, read-only, from the config the server sent at attach."""

    _info: Attached
    _sampler: RemoteSampler
    _timeout: float | None

    if TYPE_CHECKING:

        def __len__(self) -> int: ...

    @property
    def batch_size(self) -> int | None:
        """None under a ``batch_sampler``, as DataLoader's (it is the batch sampler's)."""
        if self._info.config.batch_sampler is not None:
            return None
        return self._info.config.batch_size

    @property
    def drop_last(self) -> bool:
        return self._info.config.drop_last

    @property
    def num_workers(self) -> int:
        """The server's worker processes for this loader (at attach)."""
        return self._info.config.num_workers

    @property
    def prefetch_factor(self) -> int | None:
        """Batches ahead per worker; None without workers, as with DataLoader."""
        return self._info.config.prefetch_factor if self.num_workers else None

    @property
    def persistent_workers(self) -> bool:
        """The loader's ``persistent_workers``: one base seed, worker RNGs carried across
        epochs (the server's worker processes outlive every epoch either way)."""
        return self._info.config.persistent_workers

    @property
    def pin_memory(self) -> bool:
        return self._info.config.pin_memory

    @property
    def timeout(self) -> float:
        """Seconds to wait for a batch before TimeoutError (0: forever, as DataLoader)."""
        return 0.0 if self._timeout is None else float(self._timeout)

    @property
    def dataset(self) -> RemoteDataset:
        info = self._info
        return RemoteDataset(info.config.dataset, info.dataset_length, info.sample)

    @property
    def sampler(self) -> RemoteSampler:
        return self._sampler

    @property
    def batch_sampler(self) -> RemoteBatchSampler:
        batch_size = self._info.config.batch_size
        return RemoteBatchSampler(self._sampler, batch_size, self._info.batches_per_epoch)

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """What the server applies (collating straight into the slot): default_collate,
        or a stand-in for the loader's own ``collate_fn``, which runs in the server."""
        spec = self._info.config.collate_fn
        if spec is None:
            return torch.utils.data.default_collate
        return lambda samples: _server_side(f"collate_fn {spec!r}")

    @property
    def generator(self) -> torch.Generator | None:
        """A generator that makes DataLoader shuffle as this loader does (a new one each
        time); None where DataLoader's would not matter."""
        return _seeded_generator(self._info.config)
