"""DataLoader's RNG seeding, reproduced, and the replay that rebuilds a worker's state.

DataLoader (``torch/utils/data/dataloader.py``, ``_utils/worker.py``) draws a *base
seed* from its generator at the start of each epoch's iterator (once, for persistent
workers), before the sampler's draws; worker ``w`` then seeds ``random`` and ``torch``
with ``base + w`` and numpy with ``_generate_state(base, w)``, sets its ``WorkerInfo``,
calls ``worker_init_fn(w)``, and makes batches ``w, w + N, w + 2N, ...`` of each epoch
in order (the round-robin of ``_try_put_index``). With persistent workers its RNG
carries on from one epoch to the next.

So the RNG state of worker ``w`` before batch ``(epoch, i)`` is a function of the base
seed, ``w`` and the batches it made before in that epoch (since epoch 0 with persistent
workers). ``Streams`` keeps, for each worker, the batch its state is positioned
before; a task that is not that batch (a replaced worker, a seek, a resume, a new
server, a resize) comes with a ``Reseed``: seed as DataLoader does, then *replay* the
worker's earlier batches (``__getitem__`` called, output dropped) to reach the state.

A plan whose content changes (an elastic resume: ``sampler.EpochSampler.resume``)
bumps its ``revision``: ``Streams`` then forgets every position and snapshot it had,
and a task made from the earlier plan (a sequence number below the revision's first)
neither moves a stream nor leaves a snapshot: its batch is dropped unpublished.
"""

from __future__ import annotations

import copy
import random
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from pinfeed.rng import RngState, capture, load_state, restore
from pinfeed_server.engine.collate import fetch_samples
from pinfeed_server.engine.config import LoaderConfig, make_sampler, persistent
from pinfeed_server.engine.fed_plan import FedPlan
from pinfeed_server.engine.sampler import BatchPlan, EpochSampler


@dataclass
class Reseed:
    """Put a worker's RNGs where DataLoader's worker ``worker_id`` has them before a
    batch: seeded from ``base_seed``, then ``replay`` (index batches made and dropped)."""

    worker_id: int
    num_workers: int
    base_seed: int
    replay: list[list[int]] = field(default_factory=list)
    state: bytes | None = None  # a snapshot to restore (``dump_state``) before the replay
    epoch: int = 0  # of the batch it is for (a trainer's objects of that epoch are used)


class BaseSeeds:
    """The base seed of each epoch: the ``random_`` draw DataLoader's iterator makes from
    ``Generator().manual_seed(seed)`` before the sampler draws (``sampler.py``)."""

    def __init__(self, config: LoaderConfig, streams: int, length: int) -> None:
        self._gen = torch.Generator().manual_seed(config.seed)
        # RandomSampler draws from the same generator: randperm(n), then a second one
        # once it is exhausted; a sequential or distributed sampler draws nothing.
        self._perm = length if config.shuffle and config.world_size is None else 0
        self._persistent = persistent(config, streams)
        self._seeds: list[int] = []

    def __call__(self, epoch: int) -> int:
        if self._persistent:
            epoch = 0
        while len(self._seeds) <= epoch:
            draw = torch.empty((), dtype=torch.int64).random_(generator=self._gen)
            self._seeds.append(int(draw.item()))
            if self._perm:
                torch.randperm(self._perm, generator=self._gen)
                torch.randperm(self._perm, generator=self._gen)
        return self._seeds[epoch]


# An epoch walked through, counted in samples: its own, and this for the draws' fixed
# cost (two randperms of 1,000 samples take about as long as of 11,000 on 2 cores).
WALK_EPOCH = 10_000


class History(Protocol):
    """What a replay needs of a loader's plan: each epoch's base seed and index batches."""

    def base_seed(self, epoch: int) -> int: ...

    def batches(self, epoch: int) -> Sequence[list[int] | None]: ...

    def walk_samples(self, epoch: int) -> int:
        """Samples ``batches(epoch)`` draws first: the plan's ``walk``, an epoch counted
        as its samples and ``WALK_EPOCH`` more (a randperm's own cost)."""
        ...

    def length(self, epoch: int) -> int | None:
        """The index after ``epoch``'s last batch; None while not known (a trainer-fed
        epoch still running)."""

    def revision(self) -> tuple[int, int]:
        """(how often the plan's content changed, the first task sequence number made
        from the current one)."""


class PlannedHistory:
    """A computed plan's history: a private copy of the plan (a custom sampler's
    factory called again, so the engine's own iteration is not disturbed) that follows
    the engine's plan's elastic epoch (``source``), and DataLoader's base seeds from the
    loader's seed. An elastic epoch's batches before its first are ``None``."""

    def __init__(
        self,
        config: LoaderConfig,
        streams: int,
        dataset: Any,
        allowed: tuple[str, ...] = (),
        source: BatchPlan | None = None,
    ) -> None:
        self._plan: BatchPlan = make_sampler(config, dataset, allowed, streams=streams)
        self._source = source if isinstance(source, EpochSampler) else None
        self.base_seed = BaseSeeds(config, streams, len(dataset))

    def _synced(self) -> BatchPlan:
        if self._source is not None and isinstance(self._plan, EpochSampler):
            self._plan.elastic = self._source.elastic
        return self._plan

    def batches(self, epoch: int) -> Sequence[list[int] | None]:
        plan = self._synced()
        first, _ = plan.span(epoch)
        return [None] * first + list(plan.batches(epoch, first))

    def walk_samples(self, epoch: int) -> int:
        plan = self._synced()
        return plan.walk(epoch) * (plan.samples + WALK_EPOCH)

    def length(self, epoch: int) -> int | None:
        _, end = self._synced().span(epoch)
        return len(self._plan) if end is None else end

    def revision(self) -> tuple[int, int]:
        return self._source.revision if self._source is not None else (0, 0)


class FedHistory:
    """A trainer-fed plan's history: what the trainer sent (``engine/fed_plan.py``)."""

    def __init__(self, plan: FedPlan) -> None:
        self._plan = plan

    def base_seed(self, epoch: int) -> int:
        return self._plan.base_seed(epoch)

    def batches(self, epoch: int) -> Sequence[list[int] | None]:
        return self._plan.fed(epoch)[0]

    def walk_samples(self, epoch: int) -> int:
        return 0

    def length(self, epoch: int) -> int | None:
        fed, ended = self._plan.fed(epoch)
        return len(fed) if ended else None

    def revision(self) -> tuple[int, int]:
        return 0, 0


def history_of(
    config: LoaderConfig,
    streams: int,
    plan: BatchPlan,
    dataset: Any,
    allowed: tuple[str, ...] = (),
) -> History:
    """The history of the engine's ``plan`` a replay reads."""
    if isinstance(plan, FedPlan):
        return FedHistory(plan)
    return PlannedHistory(config, streams, dataset, allowed, source=plan)


SNAPSHOTS_KEPT = 32  # per worker: RNG states after its latest batches (~10 KB each)
SNAPSHOT_WORK_S = 0.005  # a worker's batch-making between two snapshots, at least


class SnapshotCadence:
    """After which batches a worker sends its RNG state (a snapshot: ~0.1 ms to take,
    pickle and send, and as much for the server to take in): after the first batch of
    each epoch and after a reseed, then once the batches it made since its last
    snapshot took ``SNAPSHOT_WORK_S``. Snapshots then cost a worker at most ~2% of its
    time (a batch of 64 short Python samples takes ~0.5 ms: a snapshot after each cost
    it ~20%), and a replacement's replay (``Streams._reseed``, from the nearest
    snapshot) re-makes at most ``SNAPSHOT_WORK_S`` of its batches, plus the one it was
    making, never reaching back past the epoch's first."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._epoch: int | None = None
        self._since_s = 0.0

    def reset(self) -> None:
        """The worker was reseeded: snapshot after its next batch."""
        self._epoch = None

    def due(self, epoch: int, seeded: bool, seconds: float) -> bool:
        """Whether to snapshot after a batch of ``epoch`` that took ``seconds``
        (``seeded``: made on the worker's own streams)."""
        if not (self.enabled and seeded):
            return False
        self._since_s += seconds
        if epoch == self._epoch and self._since_s < SNAPSHOT_WORK_S:
            return False
        self._epoch, self._since_s = epoch, 0.0
        return True


class Streams:
    """Which worker makes a batch (``index % num_workers``) and, when its RNG is not
    already positioned before that batch, the ``Reseed`` that puts it there: from the
    nearest snapshot of the worker's RNG state at or before the batch (sent by the
    worker after some of its batches: ``SnapshotCadence``), else from the seed; then
    replay up to the batch."""

    def __init__(
        self, config: LoaderConfig, streams: int, history: History, *, replay: bool
    ) -> None:
        self.count = max(1, streams)
        self.persistent = persistent(config, streams)
        self.history = history
        self.base_seed = history.base_seed
        self.replay = replay  # False: the dataset draws nothing from the global RNGs
        self._next: dict[int, tuple[int, int]] = {}  # worker -> the batch it is ready for
        # worker -> {the batch its RNG state is ready for: that state}, oldest first
        self._snapshots: dict[int, dict[tuple[int, int], bytes]] = {}
        self._poison: set[tuple[int, int]] = set()  # batches that kill workers: not replayed
        self.replayed = 0  # batches replayed, for tests and the docs' cost figures
        self._revision, self._since = history.revision()

    def worker_of(self, index: int) -> int:
        return index % self.count

    def _after(self, w: int, epoch: int, index: int) -> tuple[int, int] | None:
        """The batch worker ``w`` makes after ``(epoch, index)`` with the RNG state it
        leaves; None: a new epoch of non-persistent workers, seeded afresh."""
        n = self.history.length(epoch)
        if n is None or index + self.count < n:  # a fed epoch may go on: assume it does
            return epoch, index + self.count
        if self.persistent and w < n:
            return epoch + 1, w
        return None

    def _current(self, seq: int) -> bool:
        """Whether task ``seq`` was made from the plan as it is now (after forgetting
        what this knew of an earlier one, if the plan changed)."""
        revision, since = self.history.revision()
        if revision != self._revision:
            self._revision, self._since = revision, since
            self._next.clear()
            self._snapshots.clear()
        return seq >= self._since

    def prepare(self, epoch: int, index: int, seq: int) -> Reseed | None:
        """Called for each task, in the order its worker will make them."""
        w = self.worker_of(index)
        if not self._current(seq):
            # Made from the plan before its latest change, its batch is dropped: any seed
            # does, and the worker's next task is reseeded.
            self._next.pop(w, None)
            return Reseed(w, self.count, self.base_seed(epoch), epoch=epoch)
        reseed = None if self._next.get(w) == (epoch, index) else self._reseed(w, epoch, index)
        after = self._after(w, epoch, index)
        if after is None:
            self._next.pop(w, None)
        else:
            self._next[w] = after
        return reseed

    def snapshot(self, epoch: int, index: int, state: bytes, seq: int) -> None:
        """The RNG state of batch ``(epoch, index)``'s worker after it made it (task
        ``seq``)."""
        if not self._current(seq):
            return
        worker = self.worker_of(index)
        after = self._after(worker, epoch, index)
        if after is None:
            return  # the end of a non-persistent epoch: the next one is seeded afresh
        kept = self._snapshots.setdefault(worker, {})
        kept.pop(after, None)
        kept[after] = state
        if len(kept) > SNAPSHOTS_KEPT:
            del kept[next(iter(kept))]

    def _reseed(self, w: int, epoch: int, index: int) -> Reseed:
        start, state = (0 if self.persistent else epoch, w), None
        if self.replay:
            kept = self._snapshots.get(w, {})
            usable = [p for p in kept if start <= p <= (epoch, index)]
            if usable:
                start = max(usable)
                state = kept[start]
        replay = self._between(w, start, (epoch, index)) if self.replay else []
        self.replayed += len(replay)
        return Reseed(w, self.count, self.base_seed(epoch), replay, state, epoch)

    def _between(self, w: int, start: tuple[int, int], stop: tuple[int, int]) -> list[list[int]]:
        """Worker ``w``'s index batches from ``start`` (included) to ``stop`` (not)."""
        out: list[list[int]] = []
        for e in range(start[0], stop[0] + 1):
            batches = self.history.batches(e)
            first = start[1] if e == start[0] else w
            last = stop[1] if e == stop[0] else len(batches)
            if first >= last:
                continue
            for j in range(first, last, self.count):
                indices = batches[j]
                if indices is not None and (e, j) not in self._poison:
                    out.append(indices)
        return out

    def forget(self, worker: int) -> None:
        """Worker ``worker``'s stream moves to a new process: its next batch comes with
        a reseed (from a snapshot where one is at hand)."""
        self._next.pop(worker, None)

    def poison(self, epoch: int, index: int) -> None:
        self._poison.add((epoch, index))


def seed_rngs(base_seed: int, worker_id: int) -> int:
    """Seed ``random``, ``torch`` and numpy as DataLoader's ``_worker_loop`` does."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]
    return seed


def apply(
    reseed: Reseed,
    dataset: Any,
    init_fn: Any = None,
    *,
    worker: bool = True,
    collate_fn: Any = None,
) -> None:
    """Seed as DataLoader's worker ``reseed.worker_id``; in a worker process also set
    ``get_worker_info()`` and call ``worker_init_fn``; then replay: each earlier batch's
    samples fetched and, with a ``collate_fn`` (which may draw too), collated, as
    DataLoader's fetcher does. A sample that raises in the replay raised in the original
    run too: its draws up to the raise count."""
    seed = seed_rngs(reseed.base_seed, reseed.worker_id)
    if worker:
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=reseed.worker_id, num_workers=reseed.num_workers, seed=seed, dataset=dataset
        )
        if init_fn is not None:
            init_fn(reseed.worker_id)  # also for a snapshot: it may set up the dataset
    if reseed.state is not None:
        load_state(reseed.state)
    for indices in reseed.replay:
        try:
            samples = fetch_samples(dataset, indices, collate_fn)
            if collate_fn is not None:
                collate_fn(samples)
        except Exception:  # the original batch raised here too, after the same draws
            continue


def _bound_to(fn: Any, old: Any, new: Any) -> Any:
    """``fn``, bound to ``new`` where it is a method of ``old``."""
    if old is not new and getattr(fn, "__self__", None) is old:
        return types.MethodType(fn.__func__, new)
    return fn


class WorkerRngs:
    """A worker process's side: the RNG state of each of the streams (DataLoader's
    worker ids) it makes batches for. One stream per process, unless a live resize
    left fewer processes than the loader's ``num_workers``: then the global states
    are swapped between streams, each batch drawing from its own stream's, and each
    further stream gets its own shallow copy of the dataset (as DataLoader's workers
    each have theirs), for ``worker_init_fn`` to set up."""

    def __init__(self, dataset: Any, streams: int, init_fn: Any, collate_fn: Any = None) -> None:
        self.dataset = dataset  # the current stream's
        self._original = dataset  # what a worker_init_fn that is its method is bound to
        self._collate_fn = collate_fn
        try:
            self._pristine = copy.copy(dataset)  # before any worker_init_fn
        except Exception:  # not copyable: further streams share it
            self._pristine = dataset
        self._datasets: dict[int, Any] = {}
        self._streams = streams
        self._init_fn = init_fn
        self._current: int | None = None
        self._saved: dict[int, tuple[RngState, Any]] = {}  # stream -> (state, WorkerInfo)

    def reseed(self, reseed: Reseed) -> None:
        self._park()
        w = reseed.worker_id
        # A worker (re)starting, as DataLoader's new worker process each epoch without
        # persistent_workers: the dataset as it was before any worker_init_fn (a fresh
        # shallow copy: attributes the last one set are gone; an in-place change of a
        # buffer stays).
        fresh = self._pristine if self._pristine is self.dataset else copy.copy(self._pristine)
        self._datasets[w] = fresh
        self.dataset = fresh
        # A worker_init_fn that is the dataset's own method sets up this copy, as a
        # forked worker's sets up the dataset it reads.
        init_fn = _bound_to(self._init_fn, self._original, fresh)
        apply(reseed, self.dataset, init_fn, collate_fn=self._collate_fn)
        self._current = w

    def enter(self, index: int) -> None:
        """Make the global RNGs batch ``index``'s stream's."""
        stream = index % self._streams
        if stream == self._current:
            return
        if stream not in self._saved:
            raise RuntimeError(f"worker stream {stream} was never seeded in this process")
        self._park()
        state, info = self._saved.pop(stream)
        restore(state)
        torch_worker._worker_info = info
        self.dataset = self._datasets[stream]
        self._current = stream

    def park(self) -> None:
        """Save the current stream's state (the caller restores the process's own)."""
        self._park()

    def _park(self) -> None:
        if self._current is not None:
            self._saved[self._current] = (capture(), torch_worker._worker_info)
            self._current = None
