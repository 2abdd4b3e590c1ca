"""Index batches with DataLoader's semantics, epoch after epoch.

Plain (``world_size`` None): with ``shuffle`` and ``seed`` s, epoch e's batches equal
those of ``DataLoader(ds, batch_size, shuffle=True, drop_last=...,
generator=Generator().manual_seed(s))`` iterated for the (e+1)-th time with
non-persistent workers. Per epoch, DataLoader's iterator draws its base seed from the
generator (``random_``), then RandomSampler draws ``randperm(n)`` and, once exhausted,
a second (empty-sliced) ``randperm(n)``. We replay exactly those draws.

Distributed (``world_size`` W, ``rank`` r): epoch e's batches equal those of
``DataLoader(ds, batch_size, drop_last=..., sampler=DistributedSampler(ds, W, r,
shuffle, seed, drop_last))`` after ``sampler.set_epoch(e)``: each rank's shard is
disjoint (up to DistributedSampler's padding) with no coordination between servers.

Custom (``sampler`` / ``batch_sampler`` fields): ``custom_sampler.CustomPlan``
iterates the user's sampler once per epoch as DataLoader does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Protocol

import torch


class BatchPlan(Protocol):
    """What the engine iterates: an epoch's batches from a position on, as index
    lists: ``EpochSampler`` (DataLoader's own samplers) or ``custom_sampler.CustomPlan``
    (a user's ``sampler``/``batch_sampler``); a plan for an iterable dataset yields
    ``None`` (the producer draws each batch from its iterators, and ends the epoch when
    they run out: see ``producers/base.py``)."""

    length: int  # the dataset's samples
    samples: int  # this rank's samples per epoch (len(DataLoader.sampler))
    max_rows: int  # the largest batch: a slot's capacity in samples

    def __len__(self) -> int: ...

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int] | None]: ...


class EpochSampler:
    def __init__(
        self,
        length: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        rank: int = 0,
        world_size: int | None = None,
        persistent: bool = False,
    ) -> None:
        if length <= 0 or batch_size <= 0:
            raise ValueError("length and batch_size must be positive")
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size - 1}]")
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.persistent = persistent  # persistent workers: one base seed, at epoch 0
        self._gen = torch.Generator()
        self._next_epoch = 0
        self._gen.manual_seed(seed)
        self.max_rows = batch_size
        if world_size is None:
            self.samples = length
        elif drop_last and length % world_size:
            self.samples = math.ceil((length - world_size) / world_size)
        else:
            self.samples = math.ceil(length / world_size)

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.samples // self.batch_size
        return (self.samples + self.batch_size - 1) // self.batch_size

    def _plain(self, epoch: int) -> torch.Tensor:
        # A tensor, not a list: 8 bytes a sample instead of ~40 (1.28 M samples: 10 MiB,
        # not 50, for every loader while its epoch runs).
        if not self.shuffle:
            return torch.arange(self.length)
        if epoch < self._next_epoch:
            # Random access backwards (resume, set_epoch): replay from the seed.
            self._gen.manual_seed(self.seed)
            self._next_epoch = 0
        perm = torch.empty(0, dtype=torch.int64)
        while self._next_epoch <= epoch:
            if not (self.persistent and self._next_epoch > 0):
                torch.empty((), dtype=torch.int64).random_(generator=self._gen)  # base seed
            perm = torch.randperm(self.length, generator=self._gen)
            torch.randperm(self.length, generator=self._gen)
            self._next_epoch += 1
        return perm

    def _distributed(self, epoch: int, world: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            indices: list[int] = torch.randperm(self.length, generator=g).tolist()
        else:
            indices = list(range(self.length))
        total = self.samples * world
        if self.drop_last:
            indices = indices[:total]
        else:
            pad = total - len(indices)
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
        return indices[self.rank : total : world]

    def permutation(self, epoch: int) -> list[int]:
        """This rank's sample order for ``epoch``."""
        if self.world_size is None:
            order: list[int] = self._plain(epoch).tolist()
            return order
        return self._distributed(epoch, self.world_size)

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """The index batches of ``epoch``, from batch ``start`` on."""
        if self.world_size is None:
            perm: torch.Tensor | list[int] = self._plain(epoch)
        else:
            perm = self._distributed(epoch, self.world_size)
        for b in range(start, len(self)):
            batch = perm[b * self.batch_size : (b + 1) * self.batch_size]
            yield batch.tolist() if isinstance(batch, torch.Tensor) else batch


def with_last(
    batches: Iterator[list[int] | None], start: int
) -> Iterator[tuple[int, list[int] | None, bool]]:
    """``(index, indices, is_last)`` for each batch of a plan's epoch (one ahead)."""
    it = iter(batches)
    try:
        current = next(it)
    except StopIteration:
        return
    for index in itertools.count(start):
        try:
            following = next(it)
        except StopIteration:
            yield index, current, True
            return
        yield index, current, False
        current = following
