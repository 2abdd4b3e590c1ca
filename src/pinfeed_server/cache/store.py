"""``SampleCache``: one dataset's samples, stored once per node, read by every process.

A lookup of sample ``i`` reads its row in the region's index (``region.py``): a
stored record is read back as views (``record.py``) and counted a hit. A miss takes
sample ``i``'s lock (``locks.py``), looks again (another worker may have stored it
meanwhile: then it is a hit, counted as a wait too), reads the sample from the dataset,
takes room at the bump pointer under the allocator's lock, writes the record, then its
row, then its state, and lets go. So two workers missing the same sample read it from
the dataset once and store it once, and a process killed while storing leaves the
entry empty (its lock goes with it; the room it took is lost, at most one sample's).

Admission is a fixed subset: the first samples that fit are kept for the cache's life,
nothing is evicted, and a sample that no longer fits is marked ``REFUSED`` and read
from the dataset each time. Under a shuffled order that keeps a random subset of
``capacity / sample size`` samples, and every epoch after the first hits on that share
(an LRU would thrash on a random order: every access is to the least recently used).

A persisted region's records from an earlier server are ``UNVERIFIED``: the first
reader checks the record's crc32c (``crc32c``: the CPU's CRC instruction, ~10 GB/s)
and its header; one that fails is counted corrupt, dropped and read from the dataset
again, never served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np

from pinfeed_server.cache import record
from pinfeed_server.cache.counters import CORRUPT, HITS, MISSES, WAITS, Counters
from pinfeed_server.cache.locks import LockTimeout, RangeLocks
from pinfeed_server.cache.region import EMPTY, READY, REFUSED, UNVERIFIED, Region
from pinfeed_server.cache.stats import CacheStats

LOCK_TIMEOUT_S = 120.0  # a sample another process reads for longer is read here too

Fetch = Callable[[int], Any]


class SampleCache:
    def __init__(
        self,
        region: Region,
        *,
        checksums: bool,
        persisted: bool = False,
        rebuilt_reason: str | None = None,
    ) -> None:
        """``checksums``: compute each record's crc32c when it is stored (a persisted
        region's, checked when an earlier server's record is first read);
        ``persisted``, ``rebuilt_reason``: what the server that opened it says of it."""
        self.region = region
        self.checksums = checksums
        self.persisted = persisted
        self.rebuilt = int(rebuilt_reason is not None)
        self.rebuilt_reason = rebuilt_reason
        self.locks = RangeLocks(region.fd)
        self.counters = Counters(self.locks, region)
        # The owner (the server) copies what it reads: user code run in the server (a
        # transform, a collate_fn at num_workers=0) must not write into the cache.
        self._copy = region.owner
        self._data_at = region.layout.data_at

    def __len__(self) -> int:
        return self.region.layout.length

    def get(self, index: int, fetch: Fetch) -> Any:
        """Sample ``index``: from the cache, or ``fetch(index)`` (and stored)."""
        state = int(self.region.states[index])
        if state in (READY, UNVERIFIED):
            sample = self._read(index, state, locked=False)
            if sample is not _MISSING:
                self.counters.add(HITS)
                return sample
        elif state == REFUSED:
            self.counters.add(MISSES)
            return fetch(index)
        try:
            with self.locks.sample(index, LOCK_TIMEOUT_S):
                return self._fill(index, fetch)
        except LockTimeout:
            self.counters.add(MISSES)
            return fetch(index)

    def _fill(self, index: int, fetch: Fetch) -> Any:
        """Under sample ``index``'s lock: read it from whoever stored it meanwhile, or
        from the dataset, and store it."""
        region = self.region
        state = int(region.states[index])
        if state in (READY, UNVERIFIED):
            sample = self._read(index, state, locked=True)
            if sample is not _MISSING:
                self.counters.add(HITS)
                self.counters.add(WAITS)
                return sample
        sample = fetch(index)
        self.counters.add(MISSES)
        if state == REFUSED:
            return sample
        p = record.plan(sample)
        if p is None:
            region.states[index] = REFUSED  # a type the cache does not keep
            return sample
        with self.locks.alloc():
            at = region.bump
            if at + p.size > region.layout.capacity:
                region.states[index] = REFUSED
                return sample
            region.bump = at + p.size
        parts = record.parts(p, index)
        region.write(self._data_at + at, parts)
        if self.checksums:
            crc = 0
            for part in parts:
                crc = crc32c.crc32c(part, crc)
            region.crcs[index] = crc
        region.offsets[index] = at
        region.lengths[index] = p.size
        region.states[index] = READY
        return sample

    def _read(self, index: int, state: int, *, locked: bool) -> Any:
        """The stored sample ``index`` (``state``: its entry's), or _MISSING where its
        record does not check out. Outside the sample's lock that only sends the caller
        to take it (a weakly ordered CPU may show a state before the row it follows);
        under it, the entry is counted corrupt and dropped, to be filled again."""
        region = self.region
        at, size = int(region.offsets[index]), int(region.lengths[index])
        start = self._data_at + at
        ok = size > 0 and at + size <= region.bump
        if ok and state == UNVERIFIED:
            with memoryview(region.reader) as mv:
                ok = crc32c.crc32c(mv[start : start + size]) == int(region.crcs[index])
        if ok:
            try:
                sample = record.read(region.reader, start, index=index, size=size, copy=self._copy)
            except record.CorruptRecord:
                ok = False
        if not ok:
            if locked:
                self.counters.add(CORRUPT)
                region.states[index] = EMPTY
            return _MISSING
        if state == UNVERIFIED:
            region.states[index] = READY  # whoever checks it too finds the same
        return sample

    # -- what the service reads and does -------------------------------------------------
    def samples(self) -> int:
        states = self.region.states
        return int(np.count_nonzero((states == READY) | (states == UNVERIFIED)))

    def used_bytes(self) -> int:
        """The region's bytes in use: its header, counters and index, and the records."""
        return self.region.layout.data_at + self.region.bump

    def stats(self) -> CacheStats:
        hits, misses, corrupt, waits = self.counters.totals()
        reads = hits + misses
        return CacheStats(
            bytes=self.used_bytes(),
            max_bytes=self.region.layout.total,
            samples=self.samples(),
            hits=hits,
            misses=misses,
            waits=waits,
            corrupt=corrupt,
            hit_ratio=hits / reads if reads else None,
            persisted=self.persisted,
            rebuilt=self.rebuilt,
            rebuilt_reason=self.rebuilt_reason,
        )

    def clear(self) -> None:
        """Forget every entry and give the records' memory back. Only while nothing
        reads the cache (the service refuses it while loaders use the dataset)."""
        region = self.region
        with self.locks.alloc():
            region.states[:] = EMPTY
            used = region.bump
            region.bump = 0
        region.release(region.layout.data_at, used)

    def close(self) -> None:
        """Unmap the region (the owner: free it); idempotent."""
        self.region.close()

    def __enter__(self) -> SampleCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MISSING: Any = object()
