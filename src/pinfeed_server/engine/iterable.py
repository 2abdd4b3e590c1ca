"""``IterableDataset``: the engine's side of a dataset that is iterated, not indexed.

DataLoader (``dataloader.py``, ``_utils/worker.py``, ``_utils/fetch.py``) gives each
of its ``N`` workers a copy of the dataset to iterate; ``get_worker_info()`` lets the
dataset split its shards; the main process asks workers for batches round-robin
(``_try_put_index``), publishes them in that order, and skips a worker that has run
out (``_IterableDatasetStopIteration``): the epoch ends once every worker has.

pinfeed keeps that order with *turns*: turn ``t`` of an epoch is worker ``t % N``'s
``(t // N)``-th request, whatever happened before, so a turn names the same batch in
every run, process or server (resume, seek, a replaced worker). The plan
(``IterablePlan``) yields turns (``None`` instead of an index list); a stream that has
run out answers its turns with nothing, which the publisher skips (``Result.rows ==
0``), and the first turn answered after every stream has run out ends the epoch
(``EndJudge``). A batch's ``index`` is therefore its turn: equal to the batches yielded
so far until the first worker runs out, with gaps after. The process side (iterators,
seeding, fast-forward) is ``producers/iterating.py``.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import IterableDataset

MAX_TURN = 2**31 - 1  # seek bound: an iterable's epoch has no known end


def is_iterable(dataset: Any) -> bool:
    """DataLoader's own test (``isinstance(dataset, IterableDataset)``)."""
    return isinstance(dataset, IterableDataset)


def dataset_len(dataset: Any) -> int | None:
    """``len(dataset)``, or None where it has none (or it raises TypeError)."""
    try:
        return len(dataset)
    except TypeError:
        return None


class IterablePlan:
    """The batch plan of an iterable: an endless run of turns (``None``); the producer
    reports the epoch's end. ``reported`` is what ``len(DataLoader)`` gives: the
    dataset's ``__len__`` with DataLoader's batch arithmetic, or None (no ``__len__``)."""

    def __init__(self, dataset: Any, batch_size: int, drop_last: bool) -> None:
        self.dataset_length = dataset_len(dataset)
        self.batch_size = batch_size
        self.max_rows = batch_size
        # BatchPlan's ints; an iterable has no index space and no sampler length.
        self.length = self.dataset_length or 0
        self.samples = 0
        n = self.dataset_length
        if n is None:
            self.reported: int | None = None
        else:
            self.reported = n // batch_size if drop_last else math.ceil(n / batch_size)

    def __len__(self) -> int:
        return self.reported or 0

    def span(self, epoch: int) -> tuple[int, None]:
        return 0, None  # its producer finds the end

    def walk(self, epoch: int) -> int:
        return 0  # no order: its producer draws from the iterators

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int] | None]:
        while True:
            yield None


def plan_len(plan: Any) -> int | None:
    """``len(loader)``: DataLoader's, which an iterable without ``__len__`` has not (a
    trainer-fed plan reports what the trainer's DataLoader said)."""
    return plan.reported if hasattr(plan, "reported") else len(plan)


def dataset_length(plan: Any) -> int | None:
    """``len(loader.dataset)`` as the trainer sees it: None for an iterable without one."""
    return plan.dataset_length if hasattr(plan, "dataset_length") else int(plan.length)


def sampler_length(plan: Any) -> int | None:
    """``len(loader.sampler)``: None for an iterable (DataLoader's
    ``_InfiniteConstantSampler`` has no length) and for a sampler without one."""
    if isinstance(plan, IterablePlan) or getattr(plan, "iterable", False):
        return None
    return int(plan.samples)


def iterable_conflict(config: Any) -> str | None:
    """DataLoader's refusal (``DataLoader.__init__``, its wording) of an option that an
    iterable cannot take, or None."""
    prefix = "DataLoader with IterableDataset: expected unspecified"
    if config.shuffle:
        return f"{prefix} shuffle option, but got shuffle={config.shuffle}"
    if config.sampler is not None:
        return f"{prefix} sampler option, but got sampler={config.sampler.factory}"
    if config.batch_sampler is not None:
        return (
            f"{prefix} batch_sampler option, but got batch_sampler={config.batch_sampler.factory}"
        )
    return None


def first_samples(dataset: Any, config: Any = None, n: int = 1) -> list[Any]:
    """The first ``n`` samples (fewer if it ends) of a fresh iterator, in the server as
    DataLoader's main process would see them, with the loader's ``RANK``/``WORLD_SIZE``:
    they size the ring. It iterates a shallow copy (as each stream does), so the probe
    leaves the dataset as registered: its workers inherit it from the server's object."""
    rank, world_size = (0, None) if config is None else (config.rank, config.world_size)
    with shard_env(rank, world_size):
        samples = list(itertools.islice(iter(copy.copy(dataset)), n))
    if not samples:
        raise ValueError("the IterableDataset yielded no sample")
    return samples


class EndJudge:
    """Whether a stream's "ran out" at turn ``(epoch, t)`` ends the epoch.

    DataLoader's epoch ends once every worker has run out. A stream runs out at the
    turn after its last batch, and answers every later turn of the epoch the same way.
    The END must come after every stream's last batch: it goes at the first "ran out"
    seen once every stream has run out at or before that turn; the other ones are
    skipped (their turns yield nothing)."""

    KEEP = 3  # epochs remembered (a seek back into the last ones)

    def __init__(self, streams: int) -> None:
        self.count = max(1, streams)
        self._out: dict[int, dict[int, int]] = {}  # epoch -> stream -> first turn out

    def ran_out(self, epoch: int, index: int) -> bool:
        """Record it; True: this turn is the epoch's END."""
        w = index % self.count
        out = self._out.setdefault(epoch, {})
        out[w] = min(out.get(w, index), index)
        for old in [e for e in self._out if e <= epoch - self.KEEP]:
            del self._out[old]
        return len(out) == self.count and max(out.values()) <= index


SHARD_ENV = ("RANK", "WORLD_SIZE")


@contextmanager
def shard_env(rank: int, world_size: int | None) -> Iterator[None]:
    """``RANK``/``WORLD_SIZE`` set to the loader's while the dataset's code runs (what
    torchrun sets in a trainer, and what sharding helpers such as WebDataset's
    ``split_by_node`` read); a loader without ``world_size`` is rank 0 of 1. For code
    run in the server process, under ``GLOBAL_RNG`` (``global_rng.py``): the old values
    come back."""
    saved = {k: os.environ.get(k) for k in SHARD_ENV}
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size or 1)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class IterRoutes:
    """The pool's routing for an iterable (in place of ``seeding.Streams``): turn ``t``
    goes to stream ``t % N``; a process positions its streams itself (fast-forward,
    ``producers/iterating.py``), so no task needs a reseed and nothing is replayed
    from here."""

    replay = False

    def __init__(self, streams: int) -> None:
        self.count = max(1, streams)

    def worker_of(self, index: int) -> int:
        return index % self.count

    def prepare(self, epoch: int, index: int, seq: int) -> None:
        return None

    def snapshot(self, epoch: int, index: int, state: bytes, seq: int) -> None:
        return None

    def forget(self, worker: int) -> None:
        return None

    def poison(self, epoch: int, index: int) -> None:
        return None
