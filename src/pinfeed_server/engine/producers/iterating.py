"""The process side of an ``IterableDataset``: one iterator per stream, DataLoader's.

A *stream* is DataLoader's worker ``w`` (of the loader's ``num_workers`` as created;
one stream at ``num_workers=0``). ``IterStreams.fetch(epoch, turn)`` returns the
samples of turn ``turn`` (stream ``turn % N``'s ``turn // N``-th request), or None when
the stream has run out, exactly as DataLoader's worker would have them:

- at the start of an epoch (every epoch; the first only with ``persistent_workers``)
  the stream gets a fresh shallow copy of the dataset, is seeded as DataLoader seeds
  worker ``w`` (``seeding.seed_rngs``, the epoch's base seed), gets its
  ``WorkerInfo`` (in a worker process; ``get_worker_info()`` stays None in the
  server, as in DataLoader's main process) and ``worker_init_fn(w)``, then calls
  ``iter(dataset)``; with ``persistent_workers`` later epochs call ``iter`` again on
  the same copy with the RNG carried on (DataLoader's ``_ResumeIteration``); a datapipe
  graph gets the epoch's shared seed (``graph_settings.apply_random_seed``) before each
  ``iter``, as DataLoader's worker applies it at its start and at each resume;
- a request draws ``batch_size`` samples (``_IterableDatasetFetcher``): a short last
  batch is a batch, or nothing with ``drop_last``; after that the stream has run out.

A turn that is not the stream's next one (a seek, a resume, a new process after a
worker died or a live resize, a server restart) is reached by *fast-forward*: the
stream starts its epoch again and draws the turns before (samples dropped), so every
draw and every RNG call happens as before. With ``persistent_workers`` a stream that
must go back starts again from epoch 0 (each epoch iterated to its end).

Several streams in one process (after a live resize left fewer processes than the
loader's ``num_workers``) each keep their RNG state, swapped into the globals while
they draw.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterDataPipe
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.graph_settings import apply_random_seed

from pinfeed.rng import RngState, capture, restore
from pinfeed_server.engine.collate import SlotWriter
from pinfeed_server.engine.config import LoaderConfig, persistent
from pinfeed_server.engine.producers.base import Result, Task, batch_result, error_info
from pinfeed_server.engine.producers.seeding import BaseSeeds, seed_rngs


@dataclass(frozen=True, slots=True)
class ShardedWorkerInfo(torch_worker.WorkerInfo):
    """``get_worker_info()`` in a worker serving an iterable: DataLoader's fields and
    the loader's ``rank`` and ``world_size`` (1 without sharding)."""

    rank: int = 0
    world_size: int = 1


@dataclass
class _Stream:
    worker_id: int
    dataset: Any = None
    epoch: int = -1  # the epoch its iterator walks; -1: never started
    round: int = 0  # requests made in that epoch
    it: Iterator[Any] | None = None
    ended: bool = False
    rng: RngState | None = None  # its RNG state while another stream's is in the globals
    info: Any = None
    at_iter: RngState | None = None  # the RNG state iter() saw (a stateful dataset's)
    snaps: dict[int, _Snapshot] = field(default_factory=dict)  # requests made -> state


SNAPSHOTS_KEPT = 64  # per stream: the states after its latest requests in the epoch
KEPT_SHARED = 64  # epochs whose shared seeds are kept (a persistent stream's rewind)


@dataclass
class _Snapshot:
    """A stateful dataset's stream after some requests: StatefulDataLoader's worker
    state (the dataset's ``state_dict()``, its iterator's when it has one) and the RNGs."""

    dataset: Any
    iterator: Any
    rng: RngState
    ended: bool


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class IterStreams:
    def __init__(
        self,
        dataset: Any,
        config: LoaderConfig,
        streams: int,
        init_fn: Any = None,
        *,
        worker: bool,
    ) -> None:
        self._pristine = dataset
        self._stateful = _stateful(dataset)  # StatefulDataLoader's convention
        self.count = max(1, streams)
        self._batch_size = config.batch_size
        self._drop_last = config.drop_last
        self._persistent = persistent(config, streams)
        self._base = BaseSeeds(config, streams, 0)  # an iterable never shuffles: no draws
        self._fed: dict[int, int] = {}  # epoch -> a base seed the trainer drew
        self._shared: dict[int, int] = {}  # epoch -> a datapipe's shared seed, likewise
        self._init_fn = init_fn
        self._worker = worker
        self._rank, self._world_size = config.rank, config.world_size or 1
        if worker:  # a worker process serves one loader: its environment is the loader's
            os.environ.update(RANK=str(self._rank), WORLD_SIZE=str(self._world_size))
        self._streams: dict[int, _Stream] = {}
        self._current: _Stream | None = None  # whose RNG state is in the globals
        self.fast_forwarded = 0  # requests drawn and dropped (tests, docs' costs)
        self.restored = 0  # streams put back from a stateful dataset's state

    def fed_seed(self, epoch: int, seed: int | None, shared: int | None = None) -> None:
        """The base seed the trainer drew for ``epoch`` (``pinfeed.DataLoader``), in place
        of the one computed from the loader's seed, and a datapipe's shared seed."""
        if seed is not None:
            self._fed[0 if self._persistent else epoch] = seed
        if shared is not None:
            self._shared[epoch] = shared
            for old in [e for e in self._shared if e < epoch - KEPT_SHARED]:
                del self._shared[old]

    def _seed(self, epoch: int) -> int:
        fed = self._fed.get(0 if self._persistent else epoch)
        return self._base(epoch) if fed is None else fed

    def fetch(self, epoch: int, index: int) -> list[Any] | None:
        """Turn ``index`` of ``epoch``: its samples, or None (the stream has run out).
        A sample that raises fails this turn only, as in DataLoader."""
        w, want = index % self.count, index // self.count
        s = self._enter(w)
        if (s.epoch != epoch or s.round > want) and not self._restore(s, epoch, want):
            rewind = s.epoch > epoch or (s.epoch == epoch and s.round > want)
            try:
                self._reach(s, epoch, rewind=rewind)
            except Exception:
                # Seeding, worker_init_fn or __iter__ raised: this turn fails, and the
                # stream has run out for the epoch (DataLoader's worker would fail
                # every request; this ends the epoch instead).
                s.epoch, s.round, s.ended, s.it = epoch, 0, True, None
                raise
        while s.round < want:
            self.fast_forwarded += 1
            self._skip(s)
        batch = self._draw(s)
        if self._stateful:
            self._snapshot(s)
        return batch

    def park(self) -> None:
        """Save the current stream's RNG state (the caller then restores its own)."""
        if self._current is not None:
            self._current.rng = capture()
            self._current.info = torch_worker._worker_info
            self._current = None

    # -- streams -----------------------------------------------------------------------
    def _enter(self, w: int) -> _Stream:
        s = self._streams.get(w)
        if s is None:
            s = self._streams[w] = _Stream(w)
        if self._current is not s:
            self.park()
            if s.rng is not None:
                restore(s.rng)
                torch_worker._worker_info = s.info
            self._current = s
        return s

    def _reach(self, s: _Stream, epoch: int, *, rewind: bool) -> None:
        """Put stream ``s`` at the start of ``epoch``, as DataLoader's worker is there."""
        if not self._persistent:
            self._start(s, epoch)
            self._iterate(s, epoch)
            return
        if rewind or s.epoch < 0:
            self._start(s, 0)
            self._iterate(s, 0)
        while s.epoch < epoch:
            while not s.ended:  # a persistent worker's epoch runs until it has run out
                self.fast_forwarded += 1
                self._skip(s)
            self._iterate(s, s.epoch + 1)

    def _start(self, s: _Stream, epoch: int) -> None:
        """A new DataLoader worker ``s.worker_id`` for ``epoch``: a fresh copy of the
        dataset, seeded, its WorkerInfo, ``worker_init_fn``."""
        try:
            s.dataset = copy.copy(self._pristine)
        except Exception:  # not copyable: the streams share it
            s.dataset = self._pristine
        seed = seed_rngs(self._seed(epoch), s.worker_id)
        if self._worker:
            torch_worker._worker_info = ShardedWorkerInfo(
                id=s.worker_id,
                num_workers=self.count,
                seed=seed,
                dataset=s.dataset,
                rank=self._rank,
                world_size=self._world_size,
            )
            if self._init_fn is not None:
                self._init_fn(s.worker_id)

    def _iterate(self, s: _Stream, epoch: int) -> None:
        s.epoch, s.round, s.ended, s.it = epoch, 0, False, None
        s.snaps.clear()
        shared = self._shared.get(epoch)
        if shared is not None and isinstance(s.dataset, IterDataPipe):
            s.dataset = apply_random_seed(s.dataset, torch.Generator().manual_seed(shared))
        s.at_iter = capture() if self._stateful else None
        s.it = iter(s.dataset)

    # -- a stateful dataset's states (StatefulDataLoader's convention) -------------------
    def _snapshot(self, s: _Stream) -> None:
        it: Any = s.it
        iterator = copy.deepcopy(it.state_dict()) if _stateful(it) and it is not s.dataset else None
        dataset = copy.deepcopy(s.dataset.state_dict())
        s.snaps[s.round] = _Snapshot(dataset, iterator, capture(), s.ended)
        while len(s.snaps) > SNAPSHOTS_KEPT:
            del s.snaps[next(iter(s.snaps))]

    def _restore(self, s: _Stream, epoch: int, want: int) -> bool:
        """Put a stateful dataset's stream back to its latest state at or before request
        ``want`` of its current epoch, as StatefulDataLoader restores a worker: the
        dataset's ``load_state_dict``, ``iter()`` (with the RNG it saw first), the
        iterator's ``load_state_dict``, the RNGs. False: none kept (fast-forward)."""
        usable = [r for r in s.snaps if r <= want] if s.epoch == epoch else []
        if not usable or s.at_iter is None:
            return False
        r0 = max(usable)
        snap = s.snaps[r0]
        try:
            restore(s.at_iter)
            s.dataset.load_state_dict(copy.deepcopy(snap.dataset))
            s.it = iter(s.dataset)
            if snap.iterator is not None:
                s.it.load_state_dict(copy.deepcopy(snap.iterator))  # type: ignore[union-attr]
        except Exception:
            return False  # the caller starts the epoch again and fast-forwards
        restore(snap.rng)
        s.round, s.ended = r0, snap.ended
        for later in [r for r in s.snaps if r > r0]:
            del s.snaps[later]  # made again from here
        self.restored += 1
        return True

    def _draw(self, s: _Stream) -> list[Any] | None:
        """One request, as ``_IterableDatasetFetcher.fetch`` with auto-collation."""
        s.round += 1
        if s.ended or s.it is None:
            return None
        data: list[Any] = []
        for _ in range(self._batch_size):
            try:
                data.append(next(s.it))
            except StopIteration:
                s.ended = True
                break
        if not data or (self._drop_last and len(data) < self._batch_size):
            s.ended = True
            return None
        return data

    def _skip(self, s: _Stream) -> None:
        # A request that raises raised in the original run too, after the same draws.
        with contextlib.suppress(Exception):
            self._draw(s)


class _Samples:
    """A batch drawn from an iterator, indexed as a map-style dataset, for the slot
    writer (which collates ``dataset[i]`` for each index)."""

    def __init__(self, samples: list[Any]) -> None:
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i: int) -> Any:
        return self._samples[i]


def write_samples(writer: SlotWriter, task: Task, samples: list[Any]) -> Result:
    """Collate ``samples`` into ``task``'s slot; the result reports their number."""
    writer.dataset = _Samples(samples)
    body = writer.write(task.slot, range(len(samples)))
    return batch_result(task.seq, body, writer, rows=len(samples))


def make_turn(streams: IterStreams, writer: SlotWriter, task: Task) -> Result:
    """A worker process's answer to an iterable's turn: the batch, an error, or
    ``Result.end`` (the stream has run out; the pool judges whether that ends the
    epoch, ``iterable.EndJudge``)."""
    try:
        streams.fed_seed(task.epoch, task.seed, task.shared)
        samples = streams.fetch(task.epoch, task.index)
        if samples is None:
            return Result(task.seq, end=True, rows=0)
        return write_samples(writer, task, samples)
    except Exception as exc:
        return Result(task.seq, error=error_info(exc))
