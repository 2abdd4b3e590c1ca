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

Elastic (``resume``): one epoch of a distributed plan may be the rest of an epoch
that a run at another world size (or batch size) left unfinished
(``pinfeed.elastic``): its batches are this rank's share of that rest, numbered from
the record's ``start`` (``span``); every other epoch is DistributedSampler's.

Shard-aware (``shard_size`` k): shard j is the samples ``[j * k, (j + 1) * k)``; an
epoch reads the shards in a random order and each shard's samples in a random order
within it (``pinfeed.elastic.shard_sequence``), and each rank a consecutive share of
that sequence, so that a rank reads about ``1 / world_size`` of the shards where the
global order makes every rank touch nearly every shard (the node cache's units: a
token file's blocks). Deterministic per seed and epoch; resume and elastic resume as
the distributed plan's (a stage resumed at another world size reads the rest of its
epoch spread as DistributedSampler spreads it; the next epoch is shard-aware again).

Mixture (``positions``): the plan is over an epoch's positions, unshuffled, and each
batch's positions become the sources' samples by the mixing rule (``mixture.py``).

Custom (``sampler`` / ``batch_sampler`` fields): ``custom_sampler.CustomPlan``
iterates the user's sampler once per epoch as DataLoader does.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from pinfeed import elastic
from pinfeed_server.engine.mixture import Positions

TOLIST_INDICES = 4096  # EpochSampler.batches: indices made Python ints at once


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

    def span(self, epoch: int) -> tuple[int, int | None]:
        """The index of ``epoch``'s first batch (0 but for an elastic epoch) and the
        index after its last (None: not known ahead, as an iterable's)."""

    def walk(self, epoch: int) -> int:
        """The epochs the plan draws in full to read ``epoch``'s batches now: where an
        epoch's order follows from the one before (DataLoader's generator, a user's
        sampler), those from the one it last read, or from the first going back; 0
        where it is drawn on its own (from ``seed + epoch``, or fed)."""
        ...


@dataclass(frozen=True)
class ElasticEpoch:
    """The epoch a distributed plan resumed into at another world size: the record
    (``pinfeed.elastic.Elastic``, what the registry and the trainer keep), this rank's
    samples of it in order, and the index after its last batch."""

    record: elastic.Elastic
    samples: torch.Tensor
    end: int

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def start(self) -> int:
        return self.record.start

    def to_json(self) -> dict[str, object]:
        """What the trainer is told: the record, with the end."""
        return {**self.record.to_json(), "end": self.end}


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
        shard_size: int | None = None,
        positions: Positions | None = None,
    ) -> None:
        """``positions``: a mixture's, which map this plan's indices (positions of an
        epoch) to samples."""
        if length <= 0 or batch_size <= 0:
            raise ValueError("length and batch_size must be positive")
        if shard_size is not None and shard_size <= 0:
            raise ValueError("shard_size must be positive")
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
        self.shard_size = shard_size
        self.positions = positions
        self._gen = torch.Generator()
        self._next_epoch = 0
        self._gen.manual_seed(seed)
        # The plain order's generator is replayed forwards: one reader at a time (the
        # engine's producer, a replay's history, the HTTP batch lookup).
        self._lock = threading.Lock()
        self.elastic: ElasticEpoch | None = None
        # (changes of the plan's content, the first task sequence number made after the
        # latest): worker streams drop what they knew of the earlier plan (seeding.py).
        self.revision = (0, 0)
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

    def plan(self) -> elastic.Plan | None:
        """What must agree for an elastic resume; None: not a distributed plan."""
        if self.world_size is None:
            return None
        return self._order()

    def _order(self) -> elastic.Plan:
        mixture = None if self.positions is None else self.positions.digest
        return elastic.Plan(
            self.length, self.shuffle, self.seed, self.drop_last, self.shard_size, mixture
        )

    def resumed(self, record: elastic.Elastic) -> ElasticEpoch:
        """This rank's share of ``record``'s epoch (a distributed plan's)."""
        assert self.world_size is not None
        plan = self.plan()
        assert plan is not None
        samples = elastic.stage_samples(plan, record, self.world_size, self.rank, self.batch_size)
        end = record.start + math.ceil(len(samples) / self.batch_size)
        return ElasticEpoch(record, samples, end)

    def resume(self, epoch: ElasticEpoch | None, since: int) -> None:
        """Make ``epoch`` the plan's elastic epoch (None: none); ``since``: the first task
        sequence number made from the new plan."""
        self.elastic = epoch
        self.revision = (self.revision[0] + 1, since)

    def span(self, epoch: int) -> tuple[int, int]:
        e = self.elastic
        if e is not None and e.epoch == epoch:
            return e.start, e.end
        return 0, len(self)

    def walk(self, epoch: int) -> int:
        if self.world_size is not None or self.shard_size is not None or not self.shuffle:
            return 0  # seed + epoch (DistributedSampler's, the shard-aware order), or none
        with self._lock:
            return epoch + 1 - (self._next_epoch if epoch >= self._next_epoch else 0)

    def _plain(self, epoch: int) -> torch.Tensor:
        # A tensor, not a list: 8 bytes a sample instead of ~40 (1.28 M samples: 10 MiB,
        # not 50, for every loader while its epoch runs).
        if self.shard_size is not None:
            return elastic.shard_sequence(self._order(), epoch)
        if not self.shuffle:
            return torch.arange(self.length)
        with self._lock:
            return self._shuffled(epoch)

    def _shuffled(self, epoch: int) -> torch.Tensor:
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

    def _distributed(self, epoch: int, world: int) -> torch.Tensor:
        e = self.elastic
        if e is not None and e.epoch == epoch:
            return e.samples
        order = elastic.epoch_order(self._order(), epoch, world)
        return elastic.spread(order, world, self.drop_last)[self.rank :: world]

    def permutation(self, epoch: int) -> list[int]:
        """This rank's sample order for ``epoch``."""
        if self.world_size is None:
            perm = self._plain(epoch)
        else:
            perm = self._distributed(epoch, self.world_size)
        order: list[int] = self._samples(epoch, perm).tolist()
        return order

    def _samples(self, epoch: int, positions: torch.Tensor) -> torch.Tensor:
        if self.positions is None:
            return positions
        return torch.from_numpy(self.positions.samples(epoch, positions.numpy()))

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """The index batches of ``epoch``, from batch ``start`` on (from the first of an
        elastic epoch, if ``start`` is before it)."""
        first, end = self.span(epoch)
        if self.world_size is None:
            perm = self._plain(epoch)
        else:
            perm = self._distributed(epoch, self.world_size)
        size = self.batch_size
        # ``tolist`` a block of batches at a time (about TOLIST_INDICES indices), not a
        # batch at a time: a call on a tensor costs microseconds whatever its length.
        step = max(1, TOLIST_INDICES // size)
        stop = end - first
        for b in range(max(start, first) - first, stop, step):
            part = perm[b * size : min(stop, b + step) * size]
            block: list[int] = self._samples(epoch, part).tolist()
            for at in range(0, len(block), size):
                yield block[at : at + size]


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
