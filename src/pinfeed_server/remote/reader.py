"""One loader's reads of one remote dataset: each batch waits for its units (``gate``),
pinned until the batch is made (``release``); the batches after it are fetched ahead.

``ahead(batches)`` starts a thread that walks the loader's future index batches (its
plan, from the engine's position on, across epochs) and fetches their units through
the node's pool of GETs, at most ``ahead_bytes`` of reads beyond the last batch gated
(counting the units already cached: the plan has no end, and a walk that counted only
what it fetched would run on through the epochs to come once the cache holds the
dataset), and in order: a batch is fetched once the cache can keep its units until its
last read (with every unit needed before then, ``ObjectCache.room_for``), and until
then nothing after it is (if its turn comes first, the batch fetches its own). So
nothing fetched ahead is evicted before it is read, to be fetched again. A seek restarts
it from the new position.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor

import numpy as np

from pinfeed_server.remote.cache import ObjectCache
from pinfeed_server.remote.errors import RemoteError
from pinfeed_server.remote.objects import Unit
from pinfeed_server.remote.reads import RemoteReads
from pinfeed_server.remote.schedule import Schedule
from pinfeed_server.remote.stats import Counts

log = logging.getLogger("pinfeed.remote")

IndexBatches = Iterator[list[int] | None]


class Reader:
    def __init__(
        self,
        name: str,
        dataset: RemoteReads,
        cache: ObjectCache,
        pool: Executor,
        ahead_bytes: int,
        max_ahead: int,
    ) -> None:
        self.name = name
        self.manifest = dataset.remote_manifest
        self._units_of = dataset.remote_units
        self.cache = cache
        self.counts = Counts()
        self.schedule = Schedule()
        self._owner = f"{self.manifest.endpoint}|{self.manifest.name}|{id(self.manifest)}"
        self._unschedule = cache.schedule(self._owner, self.schedule)
        self._pool = pool
        self._ahead_bytes = ahead_bytes
        self._max_ahead = max_ahead  # GETs in flight ahead at once
        self._cond = threading.Condition()
        self._gated = 0  # batches gated since the look-ahead (re)started
        self._gen = 0
        self._queued = 0  # bytes submitted to the pool, not yet fetched
        self._closed = False

    def units(self, indices: Sequence[int]) -> list[Unit]:
        if not indices:
            return []
        uids: dict[int, None] = {}
        for first, last in self._units_of(np.asarray(indices, dtype=np.int64)):
            for a, b in zip(first.tolist(), last.tolist(), strict=True):
                for u in range(a, b + 1):
                    uids[u] = None
        return [self.manifest.unit(u) for u in uids]

    def epoch_units(self, indices: np.ndarray) -> np.ndarray:
        return self._units_of(indices.astype(np.int64))[0][0]

    # -- the batch path ------------------------------------------------------------------
    def gate(self, epoch: int, position: int, indices: Sequence[int]) -> list[str]:
        """Wait until every unit of the batch is in the cache, pinned; their digests,
        for ``release``. Raises ``RemoteError`` (the batch's error) if one cannot be."""
        self.schedule.advance(epoch, position)
        with self._cond:
            self._gated += 1
            self._cond.notify_all()
        pinned: list[str] = []
        try:
            for unit in self.units(indices):
                self.cache.get(unit, self.manifest.name, self.counts, pin=True, owner=self._owner)
                pinned.append(unit.digest)
        except BaseException:
            self.cache.unpin(pinned)
            self.counts.add(errors=1)
            raise
        return pinned

    def release(self, digests: list[str]) -> None:
        self.cache.unpin(digests)
        with self._cond:  # room, maybe, for the batch the look-ahead waits on
            self._cond.notify_all()

    # -- look-ahead ----------------------------------------------------------------------
    def ahead(self, batches: IndexBatches) -> None:
        """Fetch ahead along ``batches`` (the loader's plan from its current batch on),
        in place of any earlier walk."""
        with self._cond:
            self._gen += 1
            self._gated = 0
            gen = self._gen
            self._cond.notify_all()
        threading.Thread(
            target=self._walk, args=(gen, batches), name=f"pinfeed-ahead-{self.name}", daemon=True
        ).start()

    def _stale(self, gen: int) -> bool:
        return self._closed or self._gen != gen

    def _walk(self, gen: int, batches: IndexBatches) -> None:
        window: deque[tuple[int, int]] = deque()  # (batch ordinal, bytes) fetched ahead
        inflight = threading.BoundedSemaphore(self._max_ahead)
        held = 0
        try:
            for ordinal, indices in enumerate(batches):
                if indices is None:
                    return
                needed = self.units(indices)
                span = sum(u.length for u in needed)  # what the batch reads, cached or not
                with self._cond:
                    while True:
                        if self._stale(gen):
                            return
                        while window and window[0][0] < self._gated:
                            held -= window.popleft()[1]
                        if held + span <= self._ahead_bytes or not window:
                            break
                        self._cond.wait(0.5)
                units = [u for u in needed if not self.cache.has(u.digest)]
                nbytes = sum(u.length for u in units)
                # The batch's units, once the cache can keep them until its last read
                # (``room_for``); until then, none after them either (they would take
                # the room first). A batch gated meanwhile fetched its own.
                while units:
                    with self._cond:
                        if self._stale(gen):
                            return
                        if ordinal < self._gated:
                            units = []
                            break
                        # the last gated batch starts at the schedule's position
                        reads = (ordinal - self._gated + 2) * len(indices)
                        queued = self._queued
                    if self.cache.room_for(nbytes, reads, queued):
                        break
                    with self._cond:  # a batch gated or made frees room
                        self._cond.wait(0.5)
                    units = self._missing(indices)
                    nbytes = sum(u.length for u in units)
                window.append((ordinal, span))
                held += span
                for unit in units:
                    inflight.acquire()
                    if self._stale(gen):
                        inflight.release()
                        return
                    with self._cond:
                        self._queued += unit.length
                    self._pool.submit(self._fetch, unit, inflight)
        except Exception:  # a plan that cannot be walked: reads still work, unhelped
            log.exception("loader %s: fetching ahead stopped", self.name)

    def _missing(self, indices: Sequence[int]) -> list[Unit]:
        return [u for u in self.units(indices) if not self.cache.has(u.digest)]

    def _fetch(self, unit: Unit, inflight: threading.BoundedSemaphore) -> None:
        try:
            self.cache.get(unit, self.manifest.name, self.counts, owner=self._owner, ahead=True)
        except RemoteError:
            pass  # the batch that needs it fetches it again, and reports the error
        except Exception:
            log.exception("loader %s: fetching %s ahead", self.name, unit)
        finally:
            with self._cond:
                self._queued -= unit.length
            inflight.release()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._unschedule()
